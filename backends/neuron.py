"""AWS Neuron adapter (``then="neuronx_cc"``, alias ``"neuron"``).

TorchNeuron (the ``torch-neuronx`` package) registers a Dynamo backend named ``"neuron"`` that lowers
graphs through StableHLO and ``neuronx-cc``. Neuron graphs cannot call back into Python, so this
delegate declares ``host_code = False``: graphpass splits the rewritten graph at its trap
boundaries (and at custom ops without an aten decomposition), runs those on the host between pieces,
and hands each piece to Neuron as a functional aten graph (lowered here by AOTAutograd, custom ops
decomposed), free of any op outside aten/prims.

When ``torch-neuronx`` is not installed the adapter raises :class:`DelegateUnavailableError` at
configuration time, before anything is traced or compiled, saying what to install.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Sequence

import torch

from graphpass.errors import DelegateError, DelegateUnavailableError

from .base import Delegate

NEURON_NAMES = ("neuronx_cc", "neuron")

INSTALL_HINT = (
    "then='neuronx_cc' hands graphs to AWS Neuron's torch.compile backend, which comes with the "
    "torch-neuronx package (TorchNeuron) on a Trainium instance with the Neuron SDK: "
    "pip install torch-neuronx neuronx-cc (from the Neuron pip repository). "
)


class NeuronDelegate(Delegate):
    name = "neuronx_cc"
    host_code = False

    def __init__(
        self,
        registered_name: str = "neuron",
        module: str | None = "torch_neuronx",
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.registered_name = registered_name
        self.module = module
        self.options = dict(options or {})

    def __repr__(self) -> str:
        return f"NeuronDelegate(registered_name={self.registered_name!r})"

    def check(self) -> None:
        if self.module is not None:
            try:
                importlib.import_module(self.module)  # registers the "neuron" Dynamo backend
            except ImportError as exc:
                raise DelegateUnavailableError(INSTALL_HINT + f"Importing {self.module!r} failed: {exc}") from None
        self._backend()

    def _backend(self) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        try:
            return lookup_backend(self.registered_name)
        except Exception:
            raise DelegateUnavailableError(
                INSTALL_HINT + f"No Dynamo backend named {self.registered_name!r} is registered in this process."
            ) from None

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """Lower ``gm`` (one piece, no graphpass ops) to aten with AOTAutograd and hand that to Neuron.

        Custom ops in ``gm`` are decomposed on the way (their ``CompositeImplicitAutograd`` kernel, or
        torch's decomposition table); graphpass leaves those without either to the host. Should an op
        other than aten/prims still come out of the lowering, a ``DelegateError`` names it before
        Neuron sees the graph."""
        from functorch.compile import make_boxed_compiler
        from torch._functorch.aot_autograd import aot_module_simplified

        from graphpass.fx_utils import aten_decomposition, is_custom_op

        backend = self._backend()
        options = self.options
        decompositions: dict = {}
        for node in gm.graph.nodes:
            if node.op == "call_function" and is_custom_op(node.target):
                decompositions.update(aten_decomposition(node.target) or {})

        def handoff(aten_gm: torch.fx.GraphModule, aten_inputs: Sequence[Any]) -> Callable:
            _refuse_non_aten(aten_gm, self.registered_name)
            if options:
                return backend(aten_gm, list(aten_inputs), options=options)
            return backend(aten_gm, list(aten_inputs))

        compiler = make_boxed_compiler(handoff)
        return aot_module_simplified(
            gm, list(example_inputs), fw_compiler=compiler, bw_compiler=compiler, decompositions=decompositions
        )


def _refuse_non_aten(aten_gm: torch.fx.GraphModule, backend_name: str) -> None:
    """Raise a DelegateError naming every op of ``aten_gm`` outside aten/prims (a custom op that a
    decomposition called, a higher-order op AOTAutograd kept), with the model line it came from."""
    from graphpass.fx_utils import non_aten_nodes, source_frame

    found = non_aten_nodes(aten_gm.graph)
    if not found:
        return
    lines = []
    for node in found:
        frame = source_frame(node)
        where = f" at {frame}" if frame is not None else ""
        lines.append(f"{node.op} {node.target} ({node.name}){where}")
    raise DelegateError(
        f"Neuron's backend {backend_name!r} compiles aten/prims ops only, and lowering a piece of the graph to "
        f"aten left: {'; '.join(lines)}. graphpass runs custom ops without an aten decomposition on the host "
        "between pieces, but this one appeared only during the lowering (inside another op's decomposition, "
        "or a higher-order op). Register an aten decomposition for it (torch._decomp.register_decomposition) "
        "or call it directly in the model's forward, so graphpass can run it on the host."
    )
