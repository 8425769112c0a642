"""Starting workers: where a worker stands in the job, and the local multi-process launcher."""

from dptrain.launch.rendezvous import WorkerEnv, detect_worker_env, init_distributed

__all__ = ["WorkerEnv", "detect_worker_env", "init_distributed"]
