"""The planner: memory and communication of a data-parallel job, predicted before launch.

Layered beside the engines: it runs their layout code on a model built on the meta
device (:mod:`~dptrain.planner.layout`), counts what each rank keeps
(:mod:`~dptrain.planner.states`), saves for backward (:mod:`~dptrain.planner.activations`)
and sends (:mod:`~dptrain.planner.traffic`).
"""

from dptrain.planner.activations import Activations, ActivationTraceError, trace_activations
from dptrain.planner.layout import PRECISIONS, STRATEGIES, Setup, Unit, units
from dptrain.planner.plan import Row, comm_buffer_bytes, plan_row
from dptrain.planner.states import States, adam, model_states, optimizer_state_bytes
from dptrain.planner.traffic import Traffic, step_traffic

__all__ = ["Activations", "ActivationTraceError", "trace_activations", "PRECISIONS", "STRATEGIES", "Setup",
           "Unit", "units", "States", "adam", "model_states", "optimizer_state_bytes", "Traffic", "step_traffic",
           "Row", "plan_row", "comm_buffer_bytes"]
