"""A differential fuzzer for the padding-safety proof (issue 33, item 2).

Static-shape bucketing pads a varying dim up to a bucket only where :func:`~.padding_proof.check_padding_safety`
proves that every real output row reads real input rows only. A proof rule that is unsound shows up as a bucketed
call whose real rows differ from eager's. This module generates random small programs from an op vocabulary that
touches every rule of the proof, compiles each with graphpass's bucketing and compares every padded call with eager.

**Programs.** A :class:`Program` is a list of :class:`Step` s (an op family, ``kind``, and its parameters). The
interpreter (:func:`program_source`) turns it, deterministically, into the Python source of an ``nn.Module``
(weights drawn from the program's seed), which :func:`build_module` executes: the source printed for a failing
program is exactly what ran. Every step maps the stream ``h`` of shape ``[B, S, D]`` (``S = L + off``, ``L`` the
padded length of the input ``x: [B, L, H]`` float32) to another such stream, or appends a side output; the
interpreter tracks ``off`` and ``D`` and adapts a step to the stream it gets (a step that cannot apply becomes a
comment), so any sub-list of steps is a valid program: that is what lets :func:`shrink` drop steps. Inputs: ``x``
always; ``ids`` (int64 ``[B, L]``) and ``attention_mask`` (int64 or bool ``[B, L]``) when a step reads them.

Op families (:data:`FAMILIES`), each with variants the proof must accept and variants it must refuse: attention
(SDPA ``is_causal``; boolean masks from ``arange`` compares ``kv + ok <= q + oq`` / ``<``, windows, ANDed with the
attention mask; additive masks ``where(mask, 0, finfo.min)`` into SDPA or a hand-written softmax/matmul attention;
keys-only masks and the legacy ``(1 - m) * finfo.min``; an OR with an all-false constant; a learned sink logit
appended after the keys and dropped after the softmax; keys that are a shifted slice ``h[:, 1:]`` or a shift padded
back, queries shorter than keys, static learned queries over padded keys); ``conv1d`` with random kernel, padding,
dilation and a slice of its output (``[..., :S]``, ``[..., 2:]``, ``[..., 1:-1]`` or none, a pointwise op first or
not); reshapes that merge the padded dim with the batch or hidden dim and split it back in the same or another order,
``flatten``/``unflatten``, permutes, ``repeat`` viewed back; integer positions ``arange(S).to(int8/int16/int32/uint8)``
used as an index, compared for a mask (as a matmul weight or in attention) or added as a bias; gathers and index ops
(``index_select``, ``gather``, ``take_along_dim``, ``x[:, idx]`` with identity / shifted / reversed / halved indices,
``x[:, -1]``, ``x[:, :-1]``, ``narrow``; static tables looked up by position, one shorter than the largest
bucket); scans (``cumsum``, ``cumprod``, ``cummax``, ``logcumsumexp``, ``diff``
with ``prepend`` / ``append``); ``cat`` and ``F.pad`` before and after the padded rows and along other dims;
reductions and normalisations (``sum``, ``mean``, ``amax``, ``max``, ``softmax``, ``log_softmax``, ``logsumexp``,
``layer_norm``, ``instance_norm``, RMS norm) over the padded and the hidden dim; sorts, flips, rolls, top-k;
pointwise ops; ``linear``, ``matmul``, ``einsum``, and products contracting the padded dim; the length used as a
value; reads of ``ids`` and ``attention_mask`` (embeddings, counts, ``cumsum == 0``).

**The property** (:func:`run_program`, the *full path*: what a user runs). The module is compiled with
``torch.compile(module, backend=graphpass.backend(then=<recording delegate>, static_shapes={"dims": {every input:
1}, "buckets": ..., "pad_value": ...}))`` and called at several lengths (the inputs' length dims marked
``maybe_mark_dynamic`` on the first call, so Dynamo traces one dynamic graph and graphpass plans it, with no
exact-size first graph; a program whose code pins the length gets static graphs and counts as refused), either with
buckets ``[16, 32, 64]`` at lengths 7, 15, 33, 63 or with ``[64, 128, 256]`` at 9, 70, 131, 200 (lengths past 127,
where ``int8`` positions wrap; the 256 bucket's padding rows reach 255, the last ``uint8`` value; programs with
narrow integer positions draw these buckets 70 % of the time, the others 20 %). Whether graphpass padded a call is read from the delegate: its compiled
function records the shapes it runs at, so a call that ran at the bucket's length instead of the call's was
padded. That observable needs nothing of graphpass's internals. Where a call was padded, every output must equal
eager's at the real length: bitwise (``torch.equal``, NaN equal to NaN) when the program only moves data, else
within ``rtol=1e-5`` and ``atol=1e-5 * (1 + max |eager|)``: padding changes the shapes of matmuls, convolutions and
attention kernels, so BLAS may block a sum differently (fp32 rounding of the same rows, never another row's value);
a padding row leaking into a real row moves it by the scale of the values, far beyond that. The padding fill is
varied: ``x`` is padded with a non-zero value in most programs (so a rule that silently relies on zero padding is
caught; with the default 0 in the rest), and ``ids`` / ``attention_mask`` with 0 or another value. The proof may
rely on the zero padding of an input only when the config pads it with 0 (the planner passes exactly those inputs as
``zero_padded``), so every fill here is one the proof is told about: varying it is never a false alarm. The mask
holds 1 at every real position except in one call per program (leading zeros), which exercises the per-call checks.
Fills are moderate (``1.5``, ``-2``, ``0.5``, ``3``), as the proof assumes finite values.

Results (:class:`Result.category`): ``refused`` (no call padded: fine), ``exact`` (padded, equal), ``WRONG``
(padded, different: a bug of the proof), ``error`` (a crash in compiling or calling; a bug unless it is a
:class:`~graphpass.errors.GraphpassError`, counted apart as ``graphpass_error``), ``invalid`` (the program fails
eagerly: a bug of this generator, never counted against graphpass) and ``graph_break`` (Dynamo split the program;
none expected).

**Shrinking** (:func:`shrink`): a failing program is shrunk greedily (drop each step, then simplify each step's
parameters, then keep only the lengths that fail) while it still fails the same way, and printed as Python source
(:func:`format_failure`).

**Cost.** One Dynamo trace (fake tensors with symbolic sizes) per program dominates: about 0.5 to 0.8 s per program
on one core of the shared 2-core machine (the test and the bench run with one intra-op thread: with torch's default
pool it was 0.98 s against 0.59 s on the same 30 programs), plus a
delegate compile per bucket (a copy of the graph) and the eager and compiled calls. Profiled over 40 programs: Dynamo
~87 % of the time, graphpass's passes (the proof included) ~6 %, the dispatcher (bucket compiles, padding, slicing)
~4 %. ``torch._dynamo.reset()`` runs before every program (Dynamo's caches otherwise grow with every new code
object); Dynamo's fake-tensor memo cache is off (its entries are never reused by another program). There is no
faster honest harness: one that traced once and ran the proof itself would still pay the same Dynamo trace (what
the proof reads), saving at most the ~10 % of graphpass's passes and bucket compiles, while no longer testing the
planner's arguments to the proof, the dispatcher's padding and slicing, or the per-call checks. So there is one
harness, the full path, for every program.
"""

from __future__ import annotations

from .emit import _interpret, build_module, program_source  # noqa: F401 (_interpret: read by the tests)
from .programs import (  # noqa: F401 (the constants: read by the tests and the bench)
    CATEGORIES,
    FAMILIES,
    LARGE,
    MIN_LEN,
    SMALL,
    X_FILLS,
    B,
    H,
    Program,
    Step,
    V,
    generate,
)
from .run import Result, _inputs, format_failure, fuzz, run_program, shrink, summarize  # noqa: F401 (_inputs: tests)

__all__ = [
    "Step",
    "Program",
    "Result",
    "FAMILIES",
    "generate",
    "program_source",
    "build_module",
    "run_program",
    "shrink",
    "format_failure",
    "fuzz",
    "summarize",
]
