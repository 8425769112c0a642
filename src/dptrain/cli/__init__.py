"""The ``dptrain`` command line: ``dptrain run``, ``launch``, ``plan``, ``bench``, ... (:mod:`~dptrain.cli.main`)."""

from dptrain.cli.main import main

__all__ = ["main"]
