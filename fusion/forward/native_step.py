"""A `FastDecoder`'s layers as one call into the project's own C step (fusion/forward/kernels/decoder_step.c), for
CPU decoding over 4- or 8-bit weights in the native kernels' layouts (fusion/forward/quantized.py).

Why: at a few rows, an eager step's time goes less to reading the weights than to dispatching dozens of small
torch operators per layer (norms, rotary, attention's pieces, residuals, dtype conversions); the C step
runs a layer as its four quantized products and a few loops, in float32, with the adapters' deltas and
attention over the cached columns read in place. `NativeLayers.of` builds the table of every layer's
weights once (pointers into the decoder's own tensors, which it keeps alive); it is None where the step
cannot run them: no kernels built, a projection not in a native layout, or adapters whose columns are
not one run per adapter.

Everything else of the step (the embedding, the rotary table, the final norm and the head) stays in
`FastDecoder.forward`; the static CUDA step never takes this path.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from fusion.forward import native_kernels
from fusion.forward.native_kernels import check_tensor
from fusion.forward.quantized import QuantizedLinear

logger = logging.getLogger(__name__)

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # decoder_step.c's order (and `fast_decode.ADAPTED`'s names)
STEP = "fusion_decode_layers"


class _Weight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("params", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("bits", ctypes.c_int)]


class _LoraStack(ctypes.Structure):
    _fields_ = [("down", ctypes.c_void_p), ("up", ctypes.c_void_p), ("ranges", ctypes.c_void_p),
                ("spans", ctypes.c_void_p), ("columns", ctypes.c_int64), ("adapters", ctypes.c_int64),
                ("is_bf16", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("projection", _Weight * 4), ("lora", _LoraStack * 4), ("qkv_bias", ctypes.c_void_p),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("key_strides", ctypes.c_int64 * 3), ("value_strides", ctypes.c_int64 * 3)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float),
                ("rows", ctypes.c_int64), ("cache_rows", ctypes.c_int64), ("width", ctypes.c_int64),
                ("cache_is_bf16", ctypes.c_int), ("mask", ctypes.c_void_p), ("mask_rows", ctypes.c_int64),
                ("adapter_rows", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("threads", ctypes.c_int), ("append", ctypes.c_int), ("columns", ctypes.c_void_p)]


def _native(projection) -> bool:
    # (`quantized.kernel_for` gives the native layout only to inputs in whole groups of 32)
    return isinstance(projection, QuantizedLinear) and projection.kernel == "native"


def adapter_ranges(owner: torch.Tensor, adapters: int) -> torch.Tensor | None:
    """(adapters, 2) int64: the run of columns [start, stop) each adapter owns in a stack whose columns
    belong to adapters `owner` (columns,); None if some adapter's columns are not one run."""
    ranges = torch.zeros(adapters, 2, dtype=torch.int64)
    for adapter in range(adapters):
        columns = (owner == adapter).nonzero().flatten()
        if columns.numel() == 0:
            continue
        start, stop = int(columns[0]), int(columns[-1]) + 1
        if stop - start != columns.numel():
            return None
        ranges[adapter] = torch.tensor([start, stop])
    return ranges


def exactly_narrowed(stack_matrix: torch.Tensor) -> torch.Tensor:
    """A float32 adapter matrix as bfloat16 where that holds every value exactly (adapters trained and saved
    in bfloat16, scaled by a power of two: the shipped ones), else as it is. The C step reads the adapters'
    matrices once a step per row block, and at a few rows that reading is what their products cost."""
    narrow = stack_matrix.to(torch.bfloat16)
    return narrow if torch.equal(narrow.float(), stack_matrix) else stack_matrix


def output_spans(up: torch.Tensor) -> torch.Tensor:
    """(columns, 2) int64: for each row of a stack's `up` (columns, n), the outputs [start, stop) outside which
    it is zero ([0, 0) for a zero row)."""
    nonzero = up != 0  # (columns, n)
    outputs = torch.arange(up.shape[1])
    start = torch.where(nonzero, outputs, up.shape[1]).amin(1)
    stop = torch.where(nonzero, outputs + 1, 0).amax(1)
    return torch.stack([start.clamp(max=stop), stop], 1).to(torch.int64)


def _non_overlapping(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a view of these sizes and strides names every element once: each axis, taken by growing
    stride, steps past all the elements the axes before it span."""
    span = 0  # the furthest offset the axes taken so far reach
    for n, stride in sorted((pair for pair in zip(sizes, strides) if pair[0] > 1), key=lambda pair: pair[1]):
        if stride <= span:
            return False
        span += (n - 1) * stride
    return True


class NativeLayers:
    """Every decoder layer of one `FastDecoder` as a table for `fusion_decode_layers` (module docstring)."""

    def __init__(self, decoder, library: ctypes.CDLL) -> None:
        self.library = library
        self.shape = (decoder.num_heads, decoder.num_kv_heads, decoder.head_dim, decoder.intermediate, decoder.eps)
        self.hidden = decoder.embed.shape[1]
        self.adapters = 0 if decoder.adapters is None else len(decoder.adapters.names)
        self._keep: list[torch.Tensor] = []  # every tensor the table points into
        self._lock = threading.Lock()  # a step writes its cache pointers into the one table
        self.table = (_Layer * len(decoder.blocks))()
        for entry, block in zip(self.table, decoder.blocks):
            for index, name in enumerate(PROJECTIONS):
                weight = getattr(block, "o_proj" if name == "o" else name)
                if weight.weights == "int4":
                    codes, params, bits = weight.nibbles, weight.scale_bias, 4
                else:
                    codes, params, bits = weight.codes, weight.scales, 8
                entry.projection[index] = _Weight(self._pointer(codes), self._pointer(params), weight.out_features,
                                                  weight.in_features, bits)
                stack = block.stacks[name] if name in block.stacks else None
                if stack is not None:
                    ranges = adapter_ranges(stack.owner.cpu(), self.adapters)
                    if ranges is None:
                        raise ValueError(f"an adapter's columns of {name} are not one run")
                    down, up = exactly_narrowed(stack.down), exactly_narrowed(stack.up)
                    entry.lora[index] = _LoraStack(self._pointer(down), self._pointer(up), self._pointer(ranges),
                                                   self._pointer(output_spans(stack.up.cpu())), stack.down.shape[0],
                                                   self.adapters, int(down.dtype == torch.bfloat16))
            # A quantized projection keeps its own bias (the fused query/key/value one; `FastDecoder` takes
            # no model whose other projections have one).
            qkv_bias = block.qkv_bias if block.qkv_bias is not None else block.qkv.bias
            if qkv_bias is not None:
                entry.qkv_bias = self._pointer(qkv_bias.float())
            entry.input_norm = self._pointer(block.input_norm.float())
            entry.post_norm = self._pointer(block.post_norm.float())

    def _pointer(self, tensor: torch.Tensor) -> int:
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    @classmethod
    def of(cls, decoder) -> NativeLayers | None:
        """The table for `decoder`'s layers, or None where the C step cannot run them (module docstring)."""
        library = native_kernels.library()
        if library is None or decoder.embed.device.type != "cpu":
            return None
        if not all(_native(getattr(block, name)) for block in decoder.blocks
                   for name in ("qkv", "o_proj", "gate_up", "down")):
            return None
        if getattr(decoder, "has_qk_norm", False):
            logger.info("decode layers run as torch operators: the C step has no query/key norms (Qwen3)")
            return None
        try:
            return cls(decoder, library)
        except ValueError as err:
            logger.info("decode layers run as torch operators: %s", err)
            return None

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
            values: list[torch.Tensor], mask: torch.Tensor, adapter_rows: torch.Tensor | None, append: bool = False,
            columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x (B, hidden) after every layer, float32, and the new keys and values (layers, B, H_kv, D) float32
        (`FastDecoder.forward`'s arguments: cos and sin (B, 1, D), keys and values per layer (B or 1, H_kv,
        width, D), mask (B or 1, 1, 1, width) bool, adapter_rows (B,) or None). With `append`, the keys and
        values are B rows of views with room for one more column (`FastDecoder.forward`), which the new ones
        are written into: None for them instead. With `columns` (B,) as well, the keys and values are one
        history's (1 row) whose views take in the rows' own columns, and row b's go into column `columns[b]`
        (`FastDecoder.prefill`)."""
        heads, kv_heads, head_dim, intermediate, eps = self.shape
        rows, layers = x.shape[0], len(self.table)
        x = x.float().contiguous()
        check_tensor(STEP, "x", x, (torch.float32,), (None, self.hidden))
        for name, table in (("cos", cos), ("sin", sin)):
            if table.numel() not in (head_dim, rows * head_dim):
                raise ValueError(f"{STEP}: {name} must hold {head_dim} or {rows} x {head_dim} values, got "
                                 f"{tuple(table.shape)}")
        cos = cos.float().reshape(-1, head_dim).expand(rows, head_dim).contiguous()  # (B, D)
        sin = sin.float().reshape(-1, head_dim).expand(rows, head_dim).contiguous()
        self._check_cache(keys, values, rows, append and columns is None)  # (columns: within the view)
        cache = keys[0]
        mask = mask.reshape(mask.shape[0], -1).contiguous()  # (B or 1, width) bool
        check_tensor(STEP, "mask", mask, (torch.bool,), (None, cache.shape[2]))
        if mask.shape[0] not in (1, rows):
            raise ValueError(f"{STEP}: mask must have 1 or {rows} rows, got {mask.shape[0]}")
        if adapter_rows is not None:
            adapter_rows = adapter_rows.to(torch.int64).expand(rows).contiguous()
            if rows and not -1 <= int(adapter_rows.min()) <= int(adapter_rows.max()) < self.adapters:
                raise ValueError(f"{STEP}: adapter_rows must lie in [-1, {self.adapters}), got "
                                 f"{adapter_rows.tolist()}")
        if columns is not None:
            columns = columns.to(torch.int64).contiguous()
            if not append or cache.shape[0] != 1 or columns.shape != (rows,):
                raise ValueError(f"columns name one column a row of one history, appended: got {tuple(columns.shape)} "
                                 f"for {rows} rows over {cache.shape[0]} cache rows")
            if not 0 <= int(columns.min()) <= int(columns.max()) < cache.shape[2]:
                raise ValueError(f"columns must lie within the {cache.shape[2]} columns given")
        elif append and cache.shape[0] != rows:
            raise ValueError(f"appending needs a cache row per row, got {cache.shape[0]} for {rows}")
        shape = _Shape(self.hidden, heads, kv_heads, head_dim, intermediate, eps, rows, cache.shape[0], cache.shape[2],
                       int(cache.dtype == torch.bfloat16), mask.data_ptr(), mask.shape[0],
                       None if adapter_rows is None else adapter_rows.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                       torch.get_num_threads(), int(append), None if columns is None else columns.data_ptr())
        new_keys = None if append else torch.empty(layers, rows, kv_heads, head_dim)
        new_values = None if append else torch.empty(layers, rows, kv_heads, head_dim)
        with self._lock:
            for entry, layer_keys, layer_values in zip(self.table, keys, values):
                entry.keys, entry.values = layer_keys.data_ptr(), layer_values.data_ptr()
                entry.key_strides[:] = layer_keys.stride()[:3]
                entry.value_strides[:] = layer_values.stride()[:3]
            status = self.library.fusion_decode_layers(ctypes.addressof(self.table), layers, ctypes.byref(shape),
                                                       x.data_ptr(), None if append else new_keys.data_ptr(),
                                                       None if append else new_values.data_ptr())
        if status != 0:
            raise MemoryError("fusion_decode_layers: could not allocate its scratch buffers")
        return x, new_keys, new_values

    def _check_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: int, append: bool) -> None:
        """The cached columns as the C step reads them: one tensor a layer, all of one shape (B or 1, H_kv,
        width, D) and dtype, the last axis dense, and with `append` room in each one's storage for the
        column written at `width` (the C writes past the view, into the buffer's next column)."""
        layers, (_, kv_heads, head_dim, _, _) = len(self.table), self.shape
        if len(keys) != layers or len(values) != layers:
            raise ValueError(f"{STEP}: keys and values must be one tensor a layer ({layers}), got {len(keys)} "
                             f"and {len(values)}")
        first = keys[0]
        check_tensor(STEP, "keys[0]", first, (torch.bfloat16, torch.float32), (None, kv_heads, None, head_dim),
                     contiguous=False)
        if first.shape[0] not in (1, rows) or first.stride(-1) != 1:
            raise ValueError(f"{STEP}: keys[0] must have 1 or {rows} rows and a dense last axis, got shape "
                             f"{tuple(first.shape)}, strides {first.stride()}")
        shape, dtype, width, size = first.shape, first.dtype, first.shape[2], first.element_size()
        apart: dict[tuple[int, ...], bool] = {}  # strides -> whether the appended column overlaps nothing
        for name, tensors in (("keys", keys), ("values", values)):
            for layer, tensor in enumerate(tensors):
                strides = tensor.stride()
                if tensor.shape != shape or tensor.dtype != dtype or strides[3] != 1 or not tensor.is_cpu:
                    raise ValueError(f"{STEP}: {name}[{layer}] must be like keys[0] ({tuple(shape)}, {dtype}, a "
                                     f"dense last axis), got {tuple(tensor.shape)}, {tensor.dtype}, strides {strides}")
                # the last element the C may touch (the appended column's) lies within the storage
                if not append:
                    continue
                if (tensor.storage_offset() + (shape[0] - 1) * strides[0] + (kv_heads - 1) * strides[1]
                        + width * strides[2] + head_dim - 1) * size >= tensor.untyped_storage().nbytes():
                    raise ValueError(f"{STEP}: {name}[{layer}] has no room for the column appended at {width}")
                if strides not in apart:
                    apart[strides] = _non_overlapping((shape[0], kv_heads, width + 1, head_dim), strides)
                if not apart[strides]:
                    raise ValueError(f"{STEP}: {name}[{layer}]'s column {width} would overwrite another row's or "
                                     f"head's columns (strides {strides})")

    @staticmethod
    def reads(keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Whether the C step reads these cached columns in place: bfloat16 or float32 with a contiguous last
        axis."""
        return all(t.dtype in (torch.bfloat16, torch.float32) and t.stride(-1) == 1 and t.device.type == "cpu"
                   for t in (*keys, *values))
