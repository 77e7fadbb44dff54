"""A quantized KV cache: keys and values kept in 8 or 4 bits, the latest tokens exact.

At GPT-2 small's width a float32 cache holds 72 KiB per token, and across many
requests and long contexts that, not the weights, is what fills memory. Storing each
number in 8 bits (or 4) cuts it about 3.5x (or 6x), at the price of a small error in
every key and value, which must be measured (`python -m roseinfer.cli.eval`).

How a group of numbers is stored (`quantize` / `dequantize`): asymmetric
quantization. A group of G numbers keeps its smallest value `zero` and a `scale`
= (largest - smallest) / (2**bits - 1); each number becomes the code
round((x - zero) / scale), an integer in 0 .. 2**bits - 1, and is read back as
zero + code * scale, off by at most scale / 2. Scale and zero are float16, two of
them per group: 4 bytes per G numbers (zero is rounded down and scale up to float16,
so every x still lies inside the range the codes cover and the bound holds for the
stored scale). int4 packs two codes a byte (`pack_int4` / `unpack_int4`).

Which numbers share a group (KIVI, Liu et al. 2024):

* keys *per channel*: the G consecutive tokens of one channel. A few key channels
  hold values far larger than the rest (outlier channels); in a per-token group
  one such channel sets the scale, and every other channel of that token is
  rounded to a handful of levels. Per channel, an outlier channel only sets its own
  scale. `keys_per="token"` is offered to show that (chapter 17).
* values *per token*: the G consecutive channels of one token. Attention mixes value
  rows with weights that sum to 1, so an error in one token's row stays in that row.

The window: the latest `window` tokens stay in the model's dtype, exactly as the
model computed them (attention weighs recent tokens most). A per-channel key group
needs G tokens, so tokens leave the exact part G at a time: once the exact part holds
window + G tokens, its oldest G are quantized and moved to the store ("flushed"), and
it goes back to `window`. So between `window` and `window + G - 1` of the latest
tokens are exact, even with window 0 (a group still filling up is exact too).

`QuantizedKVCache` is the readable reference: its `update` dequantizes the whole
store of a layer at every call and concatenates the exact tokens after it. It
implements `rosetrainer.model.KVCache` and the loop-facing interface of
`StaticKVCache` (`seq_len`, `reset(pad_lengths)`, `fork(n)`), so the generation loop
takes it as it takes the static cache.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from roseinfer.cache.dense import StaticKVCache, check_truncate
from rosetrainer.config import GPTConfig
from rosetrainer.errors import RoseError
from rosetrainer.model import GPT, LayerPast

KV_CACHE_DTYPES = ("auto", "int8", "int4")  # auto: the model's own dtype, not quantized
BITS = {"int8": 8, "int4": 4}
KEY_GROUPINGS = ("channel", "token")
DEFAULT_GROUP_SIZE = 32  # divides the head size of every preset (tiny: 32, GPT-2: 64)
DEFAULT_WINDOW = 32
METADATA_DTYPE = torch.float16  # scale and zero point of each group
METADATA_BYTES_PER_GROUP = 2 * 2  # a float16 scale and a float16 zero

# The time axis and the channel axis of a (batch, n_head, time, head_dim) key/value tensor.
TIME_DIM, CHANNEL_DIM = 2, 3


class Quantized(NamedTuple):
    """Codes and their groups' parameters; x ~ zero + codes * scale, group by group."""

    codes: torch.Tensor  # uint8, one code per number (unpacked), the shape of x
    scale: torch.Tensor  # float16, one per group: x's shape with `dim` divided by group_size
    zero: torch.Tensor  # float16, one per group: the value code 0 stands for


def _groups(x: torch.Tensor, group_size: int, dim: int) -> torch.Tensor:
    """x with `dim` moved last and split into (n_groups, group_size)."""
    return x.movedim(dim, -1).unflatten(-1, (-1, group_size))


def _ungroup(groups: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of _groups."""
    return groups.flatten(-2).movedim(-1, dim)


def _to_float16(x: torch.Tensor, direction: float) -> torch.Tensor:
    """x in float16, rounded toward `direction` (-inf: down, +inf: up) where it is not exact."""
    rounded = x.to(METADATA_DTYPE)
    off = rounded.float() > x if direction < 0 else rounded.float() < x
    toward = torch.full_like(rounded, direction)
    return torch.where(off, torch.nextafter(rounded, toward), rounded)


def quantize(x: torch.Tensor, bits: int, group_size: int, dim: int) -> Quantized:
    """Asymmetric quantization of x in groups of `group_size` consecutive numbers along `dim`.

    Every number is read back within scale / 2 of itself (its group's stored scale).
    """
    levels = 2**bits - 1
    groups = _groups(x.float(), group_size, dim)
    zero = _to_float16(groups.amin(-1, keepdim=True), -float("inf"))
    scale = _to_float16((groups.amax(-1, keepdim=True) - zero.float()) / levels, float("inf"))
    # A group of equal numbers has scale 0: every code is 0 and zero alone gives them back.
    divisor = torch.where(scale == 0, 1.0, scale.float())
    codes = ((groups - zero.float()) / divisor).round().clamp(0, levels).to(torch.uint8)
    return Quantized(
        _ungroup(codes, dim), scale.squeeze(-1).movedim(-1, dim), zero.squeeze(-1).movedim(-1, dim)
    )


def dequantize(q: Quantized, group_size: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """zero + codes * scale, each group with its own scale and zero, in `dtype`."""
    codes = _groups(q.codes, group_size, dim).float()
    scale = q.scale.movedim(dim, -1)[..., None].float()
    zero = q.zero.movedim(dim, -1)[..., None].float()
    return _ungroup(zero + codes * scale, dim).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes (0..15) a byte along the last dim: the even one low, the odd one high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: twice as many codes along the last dim."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def check_quant_settings(
    config: GPTConfig, kv_cache_dtype: str, group_size: int, window: int, keys_per: str
) -> None:
    """One clear error for each setting a quantized cache cannot work with ("auto": none
    but the dtype's name matter)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise RoseError(
            f"unknown KV cache dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if kv_cache_dtype == "auto":
        return
    if keys_per not in KEY_GROUPINGS:
        raise RoseError(
            f"keys are quantized per {' or per '.join(KEY_GROUPINGS)}, got {keys_per!r}"
        )
    if window < 0:
        raise RoseError(f"the KV cache window is a number of tokens >= 0, got {window}")
    if group_size < 1 or config.head_dim % group_size != 0:
        divisors = [d for d in range(1, config.head_dim + 1) if config.head_dim % d == 0]
        raise RoseError(
            f"KV cache group size {group_size} does not divide the head size "
            f"{config.head_dim}: use one of {', '.join(map(str, divisors))}"
        )
    if kv_cache_dtype == "int4" and config.head_dim % 2 != 0:
        raise RoseError(f"int4 packs two channels a byte; head size {config.head_dim} is odd")


def kv_bytes_per_token(
    config: GPTConfig, kv_cache_dtype: str, group_size: int = DEFAULT_GROUP_SIZE, itemsize: int = 4
) -> float:
    """Bytes one token takes in the cache, keys and values of every layer, scales included
    (auto: `itemsize`-byte numbers). The exact window adds a fixed amount per sequence."""
    numbers = 2 * config.n_layer * config.kv_width  # a key and a value per channel per layer
    if kv_cache_dtype == "auto":
        return numbers * itemsize
    return numbers * (BITS[kv_cache_dtype] / 8 + METADATA_BYTES_PER_GROUP / group_size)


class QuantizedStore:
    """Keys or values of one layer, quantized, for slots 0 .. max_len (n_stored of them used).

    `dim` is the axis a group runs along: TIME_DIM (per channel: G tokens of one channel)
    or CHANNEL_DIM (per token: G channels of one token). Codes are stored packed for int4.
    """

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        bits: int,
        group_size: int,
        dim: int,
        device: torch.device,
    ) -> None:
        self.bits, self.group_size, self.dim = bits, group_size, dim
        batch, n_head, max_len, head_dim = shape
        code_dim = head_dim // 2 if bits == 4 else head_dim
        self.codes = torch.zeros(
            (batch, n_head, max_len, code_dim), dtype=torch.uint8, device=device
        )
        if dim == TIME_DIM:  # per channel: one group per G slots, for every channel
            group_shape = (batch, n_head, -(-max_len // group_size), head_dim)
        else:  # per token: one group per G channels, for every slot
            group_shape = (batch, n_head, max_len, head_dim // group_size)
        self.scale = torch.zeros(group_shape, dtype=METADATA_DTYPE, device=device)
        self.zero = torch.zeros(group_shape, dtype=METADATA_DTYPE, device=device)

    def write(self, start: int, x: torch.Tensor) -> None:
        """Quantize x (B, H, T, D) into slots start .. start + T (start, T multiples of G
        when groups run along time)."""
        q = quantize(x, self.bits, self.group_size, self.dim)
        codes = pack_int4(q.codes) if self.bits == 4 else q.codes
        self.codes[:, :, start : start + x.size(2)] = codes
        groups = self._group_slots(start, start + x.size(2))
        self.scale[:, :, groups] = q.scale
        self.zero[:, :, groups] = q.zero

    def read(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots 0 .. n dequantized: (B, H, n, D) in `dtype`."""
        codes = self.codes[:, :, :n]
        codes = unpack_int4(codes) if self.bits == 4 else codes
        groups = self._group_slots(0, n)
        q = Quantized(codes, self.scale[:, :, groups], self.zero[:, :, groups])
        return dequantize(q, self.group_size, self.dim, dtype)

    def write_rows(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x (len(rows), H, max_len, D) into batch rows `rows`, every slot of them
        (the engine's pool: a row is a block)."""
        q = quantize(x, self.bits, self.group_size, self.dim)
        self.codes[rows] = pack_int4(q.codes) if self.bits == 4 else q.codes
        self.scale[rows] = q.scale
        self.zero[rows] = q.zero

    def read_rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Batch rows `rows` dequantized: (len(rows), H, max_len, D) in `dtype`."""
        codes = self.codes[rows]
        codes = unpack_int4(codes) if self.bits == 4 else codes
        q = Quantized(codes, self.scale[rows], self.zero[rows])
        return dequantize(q, self.group_size, self.dim, dtype)

    def _group_slots(self, start: int, end: int) -> slice:
        """Where the parameters of slots start .. end sit along time."""
        if self.dim == TIME_DIM:
            return slice(start // self.group_size, end // self.group_size)
        return slice(start, end)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.zero.nbytes


class QuantizedLayerCache:
    """One layer: a quantized store for the older tokens, the latest ones exact.

    Slots 0 .. n_stored are in the stores; the n_exact tokens after them sit in
    `exact_k` / `exact_v` in the model's dtype. Every update adds the new tokens to the
    exact part, then flushes its oldest G tokens, a group at a time, while more than
    `window` would stay.
    """

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        bits: int,
        group_size: int,
        window: int,
        keys_per: str,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        key_dim = TIME_DIM if keys_per == "channel" else CHANNEL_DIM
        self.keys = QuantizedStore(shape, bits, group_size, key_dim, device)
        self.values = QuantizedStore(shape, bits, group_size, CHANNEL_DIM, device)
        self.group_size, self.window, self.dtype = group_size, window, dtype
        batch, n_head, _, head_dim = shape
        # The exact part never holds window + G tokens after an update (it flushes then).
        exact_shape = (batch, n_head, window + group_size, head_dim)
        self.exact_k = torch.zeros(exact_shape, dtype=dtype, device=device)
        self.exact_v = torch.zeros(exact_shape, dtype=dtype, device=device)
        self.n_stored = 0
        self.n_exact = 0

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> LayerPast:
        # The exact tokens, then the new ones: everything not yet in the stores, in order.
        k = torch.cat([self.exact_k[:, :, : self.n_exact], k_new], dim=2)
        v = torch.cat([self.exact_v[:, :, : self.n_exact], v_new], dim=2)
        n_flush = max(0, k.size(2) - self.window) // self.group_size * self.group_size
        if n_flush:
            self.keys.write(self.n_stored, k[:, :, :n_flush])
            self.values.write(self.n_stored, v[:, :, :n_flush])
            self.n_stored += n_flush
        self.n_exact = k.size(2) - n_flush
        self.exact_k[:, :, : self.n_exact] = k[:, :, n_flush:]
        self.exact_v[:, :, : self.n_exact] = v[:, :, n_flush:]
        return self.read()

    def read(self) -> LayerPast:
        """What attention reads: the store dequantized, then the exact tokens."""
        n = self.n_exact
        k = torch.cat([self.keys.read(self.n_stored, self.dtype), self.exact_k[:, :, :n]], dim=2)
        v = torch.cat([self.values.read(self.n_stored, self.dtype), self.exact_v[:, :, :n]], dim=2)
        return k, v

    def clear(self) -> None:
        self.n_stored = self.n_exact = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.exact_k.nbytes + self.exact_v.nbytes


class QuantizedKVCache(StaticKVCache):
    """A static cache whose slots hold int8 or int4 codes, with the latest tokens exact.

    Slots, positions, padding and masks work as in StaticKVCache (the mask keeps the
    columns of the slots filled so far: `update` returns exactly that many keys).
    kv_cache_dtype: "int8" or "int4"; window: latest tokens kept exact (0: only a group
    still filling up); group_size: numbers per scale and zero, a divisor of the head
    size; keys_per: "channel" (KIVI) or "token".
    """

    compilable = False  # the flush depends on Python counts: no fixed-shape decode step

    def __init__(
        self,
        model: GPT,
        batch_size: int = 1,
        max_len: int | None = None,
        *,
        kv_cache_dtype: str = "int8",
        window: int = DEFAULT_WINDOW,
        group_size: int = DEFAULT_GROUP_SIZE,
        keys_per: str = "channel",
    ) -> None:
        cfg = model.config
        check_quant_settings(cfg, kv_cache_dtype, group_size, window, keys_per)
        if kv_cache_dtype == "auto":
            raise RoseError("kv_cache_dtype 'auto' is the unquantized StaticKVCache; use that")
        blocks = model.transformer.h  # one layer cache per block, where its weights live
        weight = blocks[0].attn.c_attn.weight
        self._init_slots(cfg, max_len, weight.device)
        self.kv_cache_dtype, self.window, self.group_size = kv_cache_dtype, window, group_size
        self.keys_per = keys_per
        shape = (batch_size, cfg.kv_heads, self.max_len, cfg.head_dim)
        self.layers = [
            QuantizedLayerCache(
                shape,
                BITS[kv_cache_dtype],
                group_size,
                window,
                keys_per,
                weight.dtype,
                weight.device,
            )
            for _ in range(len(blocks))
        ]
        self.reset()

    @property
    def batch_size(self) -> int:
        return self.layers[0].keys.codes.size(0)

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds: codes, scales, zeros and the exact window."""
        return sum(layer.nbytes for layer in self.layers)

    def reset(self, pad_lengths: torch.Tensor | None = None) -> None:
        super().reset(pad_lengths)
        for layer in self.layers:
            layer.clear()

    def filled_kv(self) -> list[LayerPast]:
        """The filled positions as attention reads them (dequantized, then exact)."""
        return [layer.read() for layer in self.layers]

    def truncate(self, n: int) -> None:
        """Keep the first n positions. Only exact tokens can go: a group already in the
        store was quantized with the later tokens in it (their scale and zero point)."""
        check_truncate(n, self.seq_len)
        stored = self.layers[0].n_stored
        if n < stored:
            raise RoseError(
                f"cannot roll the quantized cache back to {n} positions: the first {stored} "
                f"are quantized already; keep at least as many tokens exact as are drafted "
                f"(a larger window)"
            )
        for layer in self.layers:
            layer.n_exact = n - layer.n_stored
        super().truncate(n)

    def prepare(
        self, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos, mask = super().prepare(batch, q_len, device)
        return pos, mask[..., : self.seq_len]  # update returns the filled slots only

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> LayerPast:
        return self.layers[layer].update(k, v)

    def fork(self, n: int) -> list[QuantizedKVCache]:
        """n independent copies (stores and counts copied)."""
        forks = []
        for _ in range(n):
            fork = copy.copy(self)
            fork.layers = [copy.deepcopy(layer) for layer in self.layers]
            fork.filled = self.filled.clone()
            forks.append(fork)
        return forks


def make_kv_cache(
    model: GPT,
    batch_size: int = 1,
    max_len: int | None = None,
    *,
    kv_cache_dtype: str = "auto",
    window: int = DEFAULT_WINDOW,
    group_size: int = DEFAULT_GROUP_SIZE,
    keys_per: str = "channel",
) -> StaticKVCache:
    """The static cache for `kv_cache_dtype`: unquantized for "auto", else quantized."""
    check_quant_settings(model.config, kv_cache_dtype, group_size, window, keys_per)
    if kv_cache_dtype == "auto":
        return StaticKVCache(model, batch_size=batch_size, max_len=max_len)
    return QuantizedKVCache(
        model,
        batch_size,
        max_len,
        kv_cache_dtype=kv_cache_dtype,
        window=window,
        group_size=group_size,
        keys_per=keys_per,
    )
