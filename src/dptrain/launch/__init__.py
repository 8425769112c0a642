"""Starting workers: where a worker stands in the job (``rendezvous``), the local multi-process launcher
(``local``, ``workers``), torchrun's agent for restarts and nodes (``elastic``), and the runner of a user's
script (``script``).

Nothing is imported here: the launchers do not import torch (a second at each start), only the workers do.
"""
