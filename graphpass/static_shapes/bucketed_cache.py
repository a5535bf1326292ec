"""A transformers key/value cache whose sizes are buckets: static decode graphs for ``generate()``.

transformers' dynamic cache grows by one slot per generated token, so every decode step has another
key length and a static-shape compiler (AWS Neuron, XLA) compiles once per step. Its static cache has
one size, chosen before generation. :class:`BucketedCache` sits in between: its per-layer key/value
buffers hold ``capacity`` slots, where the capacity is the smallest *decode-context bucket* that
holds what the cache must take, and it grows (re-allocated into the next bucket, the filled slots
copied) only between forwards. A decode step's graph therefore has only static sizes (one query,
``capacity`` keys): one graph per context bucket, whatever the prompt and the number of new tokens.

How it stays exact (docs/static-shapes.md, "Generation"):

* The true length lives on the host (a Python int) and in a 0-d tensor per layer that the forward reads
  (``get_seq_length``): the positions are ``arange(n) + length``. The forward never changes it: a
  forward pre-hook sets it before the call and a forward post-hook advances it by the call's *true*
  query length afterwards. So when graphpass pads a prefill to its bucket, the padding rows never count
  as cached tokens (a length computed in the graph would be the bucket's).
* ``update`` writes the step's rows at slots ``length .. length + n - 1`` (``index_copy_``) and returns
  the whole buffer. transformers builds the attention mask from ``get_mask_sizes`` (``capacity`` keys at
  offset 0) and the positions: query ``i`` (position ``length + i``) sees slot ``j`` only if ``j <=
  length + i``. Slots past a real query's position (never written: zeros; or written by the padding
  rows of a padded prefill: ``length + n ..``) are masked for every real query, and a later step writes
  slot ``length`` before any query can see it. Masked slots get weight exactly 0, and what they hold
  is finite (zeros, or rows computed from the pad token), so they add exactly 0.
* The prefill's padding rows need slots too: the pre-hook reserves ``length + prefill bucket`` slots
  (the ``prefill_buckets`` must be the ``static_shapes`` buckets the model is compiled with).

The hooks run only outside a compiled region: compile the model's ``forward``
(``model.forward = torch.compile(model.forward, ...)``), not the module, so that module hooks stay
eager. Under a compiled module a hook raises inside Dynamo's trace, and Dynamo then runs it eagerly
(a graph break): its host-side state never becomes part of a graph.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import torch

from .config import check_buckets
from ..errors import ConfigError

log = logging.getLogger("graphpass.static_shapes.bucketed_cache")

try:  # transformers is optional for graphpass; the class needs it
    from transformers.cache_utils import Cache, StaticLayer
except ImportError:  # pragma: no cover - transformers not installed
    Cache = StaticLayer = None

__all__ = ["BucketedCache", "BucketedLayer"]


def _bucket_for(buckets: Sequence[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


if StaticLayer is not None:

    class BucketedLayer(StaticLayer):
        """One layer's buffers ``[batch, kv_heads, capacity, head_dim]``; the owner
        (:class:`BucketedCache`) allocates, grows and advances them between forwards."""

        # not transformers' "compileable" cache: generate() then builds no 4-D mask outside the model
        # (its key length would change with every bucket) and compiles nothing by itself
        is_compileable = False
        is_croppable = False
        host_length = 0  # the true length, as a Python int (eager calls)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            raise ConfigError(
                "cache",
                type(self).__name__,
                "BucketedCache is filled between forwards by the hooks of BucketedCache.attach(model); "
                "this forward ran without them (attach the cache to the model that uses it)",
            )

        def allocate(
            self,
            batch: int,
            heads: int,
            head_dim: int,
            capacity: int,
            dtype: torch.dtype,
            device: torch.device,
            filled: int,
        ) -> None:
            """Buffers of ``capacity`` slots, the first ``filled`` copied from the old ones."""
            keys = torch.zeros((batch, heads, capacity, head_dim), dtype=dtype, device=device)
            values = torch.zeros((batch, heads, capacity, head_dim), dtype=dtype, device=device)
            if self.is_initialized and filled:
                keys[:, :, :filled] = self.keys[:, :, :filled]
                values[:, :, :filled] = self.values[:, :, :filled]
            # the slot dim is a bucket: Dynamo must not make it symbolic when it changes
            for t in (keys, values):
                torch._dynamo.mark_static(t, 2)
            self.keys, self.values = keys, values
            self.max_cache_len = capacity
            self.device = device
            self.is_initialized = True

        def set_length(self, n: int) -> None:
            self.host_length = n
            self.cumulative_length.fill_(n)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            """Write the step's rows at slots ``length ..`` and return the whole buffers. The length is
            not advanced here (the post-hook does it with the true, unpadded query length)."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            slots = torch.arange(key_states.shape[-2], device=self.keys.device) + self.cumulative_length
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
            if not torch.compiler.is_compiling():
                # eager: the filled slots only (transformers skips the mask of a one-token query outside a
                # compiled region, which would let it see the unfilled ones)
                end = self.host_length + key_states.shape[-2]
                return self.keys[:, :, :end], self.values[:, :, :end]
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            if not torch.compiler.is_compiling():
                return self.host_length + query_length, 0
            return self.max_cache_len, 0

        def crop(self, tokens_to_remove: int) -> None:
            raise ConfigError("cache", "crop", "BucketedCache cannot be cropped")

    class BucketedCache(Cache):
        """A key/value cache for ``generate()`` whose buffers are sized by decode-context buckets.

        config: the model's config (``model.config``).
        buckets: the decode-context buckets, strictly increasing: the buffers hold the smallest bucket
            >= the tokens the cache must take; the largest bounds prompt + new tokens (+ the prefill's
            padding: ``length + prefill bucket``).
        prefill_buckets: the ``static_shapes["buckets"]`` the model is compiled with (the prefill is
            padded to them; their padding rows need slots too). Default: no padding reserved.

        Use it with :meth:`attach` (the hooks that fill and grow it between forwards)::

            cache = BucketedCache(model.config, buckets=[64, 96, 128], prefill_buckets=[16, 32, 64])
            with cache.attach(model):
                out = model.generate(ids, max_new_tokens=32, cache=cache)
        """

        def __init__(self, config: Any, buckets: Sequence[int], prefill_buckets: Sequence[int] | None = None) -> None:
            self.buckets = check_buckets("buckets", list(buckets) if isinstance(buckets, tuple) else buckets)
            self.prefill_buckets = (
                check_buckets(
                    "prefill_buckets", list(prefill_buckets) if isinstance(prefill_buckets, tuple) else prefill_buckets
                )
                if prefill_buckets is not None
                else ()
            )
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            if getattr(text, "is_encoder_decoder", False):
                raise ConfigError("config", type(config).__name__, "BucketedCache is for decoder-only models")
            if set(getattr(text, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
                raise ConfigError(
                    "config",
                    sorted(set(text.layer_types)),
                    "BucketedCache supports full-attention layers only (sliding-window or linear "
                    "attention layers keep another kind of state)",
                )
            self.num_heads, self.head_dim = _kv_shape(text)
            self.length = 0  # tokens cached (host side, the truth)
            super().__init__(layers=[BucketedLayer(max_cache_len=0) for _ in range(text.num_hidden_layers)])
            self._share_length(torch.zeros((), dtype=torch.long))

        def _share_length(self, length: torch.Tensor) -> None:
            """One length tensor for every layer: one graph input, so the positions the mask is built
            from (layer 0's length) and the slots each layer writes are provably the same offset."""
            for layer in self.layers:
                layer.cumulative_length = length

        # -- sizes ------------------------------------------------------------------------------
        def slots_needed(self, n: int) -> int:
            """Slots the next forward of ``n`` tokens writes: ``length + n``, with ``n`` padded to its
            prefill bucket when it is one graphpass pads (more than one token, within the buckets)."""
            padded = _bucket_for(self.prefill_buckets, n) if n > 1 else None
            return self.length + (padded or n)

        def capacity_for(self, n: int) -> int:
            need = self.slots_needed(n)
            cap = _bucket_for(self.buckets, need)
            if cap is None:
                raise ConfigError(
                    "buckets",
                    list(self.buckets),
                    f"the cache must hold {need} slots ({self.length} cached + {n} new"
                    f"{' padded to its prefill bucket' if need - self.length != n else ''}), more than "
                    f"the largest decode-context bucket: add a bucket >= {need}",
                )
            return cap

        # -- the hooks ----------------------------------------------------------------------------
        def before_forward(self, tokens: torch.Tensor, dtype: torch.dtype) -> None:
            """Grow the buffers to the bucket this forward needs and set the layers' lengths."""
            n = int(tokens.shape[1])
            cap = self.capacity_for(n)
            first = self.layers[0]
            if first.cumulative_length.device != tokens.device:
                self._share_length(first.cumulative_length.to(tokens.device))
            if not first.is_initialized or first.max_cache_len < cap:
                log.debug("BucketedCache: %d cached, %d new -> %d slots", self.length, n, cap)
                for layer in self.layers:
                    layer.allocate(
                        int(tokens.shape[0]), self.num_heads, self.head_dim, cap, dtype, tokens.device, self.length
                    )
            for layer in self.layers:
                layer.set_length(self.length)

        def after_forward(self, tokens: torch.Tensor) -> None:
            n = int(tokens.shape[1])
            self.length += n
            for layer in self.layers:
                if n > 1:  # the slots a padded prefill's padding rows wrote: zeros again, as unpadded
                    layer.keys[:, :, self.length :].zero_()
                    layer.values[:, :, self.length :].zero_()
                layer.set_length(self.length)

        @contextlib.contextmanager
        def attach(self, model: torch.nn.Module) -> Iterator["BucketedCache"]:
            """Register, for the ``with`` block, the forward hooks on ``model`` that fill this cache."""
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

            def tokens_of(kwargs: dict, args: tuple) -> torch.Tensor | None:
                if kwargs.get("cache", kwargs.get("past_key_values")) is not self:
                    return None
                t = kwargs.get("input_ids")
                if t is None:
                    t = kwargs.get("inputs_embeds")
                if t is None and args:
                    t = args[0]
                if torch.compiler.is_compiling():
                    raise ConfigError(
                        "cache",
                        "BucketedCache",
                        "its forward hooks are being traced: compile the model's forward "
                        "(model.forward = torch.compile(model.forward, ...)), not the module",
                    )
                return t

            def pre(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
                t = tokens_of(kwargs, args)
                if t is None:
                    return None
                self.before_forward(t, dtype)
                if t.shape[1] > 1 and kwargs.get("logits_to_keep"):
                    # generate() asks the prefill for the last position's logits only: in a padded graph
                    # that row is padding (graphpass refuses to pad such a graph), so ask for all of them
                    return args, {k: v for k, v in kwargs.items() if k != "logits_to_keep"}
                return None

            def post(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
                t = tokens_of(kwargs, args)
                if t is not None:
                    self.after_forward(t)

            handles = [
                model.register_forward_pre_hook(pre, with_kwargs=True),
                model.register_forward_hook(post, with_kwargs=True),
            ]
            try:
                yield self
            finally:
                for h in handles:
                    h.remove()

        def reset(self) -> None:
            super().reset()
            self.length = 0
            for layer in self.layers:
                layer.host_length = 0

else:  # pragma: no cover - transformers not installed

    class BucketedCache:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ConfigError("cache", "BucketedCache", "needs transformers (pip install transformers)")

    BucketedLayer = None  # type: ignore[assignment,misc]


def _kv_shape(text: Any) -> tuple[int, int]:
    """(key/value heads, head dim) of a decoder config."""
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if not kv or not head_dim:
        raise ConfigError("config", type(text).__name__, "cannot read the key/value heads and head dim from it")
    return int(kv), int(head_dim)
