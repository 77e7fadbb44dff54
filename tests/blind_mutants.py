"""Wrong answers written blind, by someone who had not read these lists (issue 45).

Their writer had read each exercise's and each build's contract (the stubs, the chapters),
but neither tests/mutants.py nor the known wrong answers of rosecourse/exercises and
rosecourse/builds. For each, they wrote the mistakes a learner seemed likely to make, and
said which in one line; that line is the `# WRONG:` comment above each answer here. They
are the suites' own mechanism (tests/mutants.py), registered with `blind` and
`blind_build`: a mutant, which must fail its check without being taken for a known mistake,
or, where the check names it as one of the known mistakes (its writer found that one too),
`known=` that mistake, whose diagnosis it must get.

A chapter's answer is its writer's own function, the mistake where they put it; answers of
one chapter that share a body share it here (`_blind_NN`), the mistake an argument. A
build's writer wrote the whole module; here the mistake is put into the build's reference
solution, in the method it was in (`# the mistake` marks the line), as tests/mutants.py
writes its own, so that a build has one reference its wrong answers are read against.

Left out, of the 126 written: three that compute what the reference computes on every input
the engine can give them, so that no check can fail them:
  12 no_final_sort     (`running` not sorted by arrival at the end of a step): running holds
                       the oldest requests in arrival order (preemption takes the newest,
                       and a preempted one waits ahead of every newer one), so the sort
                       never moves a sequence;
  17 zero_scale_nan    (no guard for a scale of 0): a constant group's codes come from
                       0 / 0, a NaN that the cast to uint8 makes 0, the right code;
  cached_loop chunk_remainder_first (the short prefill chunk first): the same calls, none
                       longer than prefill_chunk, in another order, an answer the suite
                       takes as right (mutants.loop_that_feeds_the_last_token_too).
Five others passed the checks when written and were caught by checks made since: 04's
positions made on the CPU whatever `device` says (a GPU's model fails), 05's unstable sort
(ties not by token order), 13's block found by its key alone (a collision), the model's
positions made on the CPU, and the block manager's can_start counting the evictable blocks
it is served as room to grow into.
"""

from __future__ import annotations

import hashlib
import math

import torch

# The names the builds' answers read (each runs with the learner module's globals: these
# are the reference's, for the reader and the linter).
from mutants import blind_build
from torch import nn
from torch.nn import functional as F

from rosecourse.builds.block_manager import reference as reference_block_manager
from rosecourse.builds.block_manager.reference import chain_hash
from rosecourse.builds.cached_loop.reference import StaticCache, StaticLayer
from rosecourse.builds.model.reference import MLP, Block, CausalSelfAttention
from rosecourse.builds.training_step.reference import clip_gradients, learning_rate
from rosecourse.builds.verify.reference import accept_or_resample, score

# == The builds: the mistake put into the reference solution ===============================

# -- build block_manager: chain_hash, BlockManager ---------------------------------------------


# WRONG: chain_hash joins the tokens with no separator: (1, 23) and (12, 3) collide
@blind_build("block_manager", "chain_hash")
def hash_no_separator(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = parent + b"|" + "".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


# WRONG: chain_hash ignores the parent key: a block keyed by its own tokens only
@blind_build("block_manager", "chain_hash", known="unchained")
def hash_without_parent(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    # the mistake: was `data = parent + b"|" + ",".join(map(str, token_ids)).encode()`
    data = b"|" + ",".join(map(str, token_ids)).encode()
    return hashlib.sha256(data).digest()


# Each a subclass of the reference's BlockManager, with the method the mistake is in.
_Blind = reference_block_manager.BlockManager


# WRONG: can_start counts unheld cached blocks it would take as still available to grow into
@blind_build("block_manager", "BlockManager", name="can_start_ignores_unheld")
class CanStartIgnoresUnheld(_Blind):
    def can_start(self, cached_ids, num_tokens):
        needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)
        # the mistake: was `return needed <= self.num_free + len(self.evictable) - unheld`
        return needed <= self.num_free + len(self.evictable)


# WRONG: can_start uses < instead of <=: refuses a sequence that exactly fits the pool
@blind_build("block_manager", "BlockManager", name="can_start_strict")
class CanStartStrict(_Blind):
    def can_start(self, cached_ids, num_tokens):
        unheld = sum(1 for block_id in cached_ids if self.blocks[block_id].ref_count == 0)
        needed = -(-num_tokens // self.kv_block_size) - len(cached_ids)
        # the mistake: was `return needed <= self.num_free + len(self.evictable) - unheld`
        return needed < self.num_free + len(self.evictable) - unheld


# WRONG: can_grow counts only free blocks, not the evictable cached ones
@blind_build(
    "block_manager", "BlockManager", name="can_grow_free_only", known="cached_blocks_unavailable"
)
class CanGrowFreeOnly(_Blind):
    def can_grow(self, seq, num_tokens):
        needed = -(-num_tokens // self.kv_block_size) - len(seq.block_table)
        # the mistake: was `return needed <= self.num_free + len(self.evictable)`
        return needed <= self.num_free


class _BlindStart(_Blind):
    """start, its counters and num_cached_tokens as `queries(seq, num_tokens)` and
    `first_start(seq)` say."""

    def queries(self, seq, num_tokens):
        return self.lookup_blocks(len(seq.all_ids))

    def first_start(self, seq):
        return not seq.output_ids

    def start(self, seq, cached_ids, num_tokens):
        self.prefix_cache_queries += self.queries(seq, num_tokens)
        self.prefix_cache_hits += len(cached_ids)
        for block_id in cached_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_ids)
        seq.block_hashes = [self.blocks[block_id].hash for block_id in cached_ids]
        seq.num_computed_tokens = len(cached_ids) * self.kv_block_size
        if self.first_start(seq):
            seq.num_cached_tokens = seq.num_computed_tokens
        self.grow(seq, num_tokens)


# WRONG: num_cached_tokens overwritten on a restart after preemption too
@blind_build("block_manager", "BlockManager", name="cached_tokens_on_restart")
class CachedTokensOnRestart(_BlindStart):
    def first_start(self, seq):
        return True  # the mistake: was `return not seq.output_ids`


# WRONG: prefix_cache_hits counted per block found but queries counted only on a first start
@blind_build("block_manager", "BlockManager", name="hits_count_on_restart_only_new")
class HitsCountOnRestartOnlyNew(_BlindStart):
    def queries(self, seq, num_tokens):
        # the mistake: was `return self.lookup_blocks(len(seq.all_ids))`
        return 0 if seq.output_ids else self.lookup_blocks(len(seq.all_ids))


# WRONG: prefix_cache_queries counts lookup_blocks(num_tokens) (the tokens to grow to), not
# of the whole sequence
@blind_build("block_manager", "BlockManager", name="queries_count_num_tokens")
class QueriesCountNumTokens(_BlindStart):
    def queries(self, seq, num_tokens):
        return self.lookup_blocks(num_tokens)  # the mistake: was `len(seq.all_ids)`


# WRONG: lookup_blocks ignores enable_prefix_caching (cached_prefix returns [] itself):
# queries counted without prefix caching
@blind_build("block_manager", "BlockManager", name="lookup_ignores_flag")
class LookupIgnoresFlag(_Blind):
    def lookup_blocks(self, num_tokens):
        # the mistake: `if not self.enable_prefix_caching: return 0` moved to cached_prefix
        return (num_tokens - 1) // self.kv_block_size

    def cached_prefix(self, token_ids):
        if not self.enable_prefix_caching:
            return []
        return super().cached_prefix(token_ids)


# WRONG: lookup_blocks = num_tokens // size: a prompt of whole blocks gets its last token's
# block served
@blind_build(
    "block_manager", "BlockManager", name="lookup_serves_last_block", known="serves_the_last_token"
)
class LookupServesLastBlock(_Blind):
    def lookup_blocks(self, num_tokens):
        if not self.enable_prefix_caching:
            return 0
        return num_tokens // self.kv_block_size  # the mistake: was `(num_tokens - 1)`


class _BlindGrow(_Blind):
    """grow, taking a free block when `take_free()` and evicting `evictable.popitem(last=
    self.newest_first)` otherwise."""

    newest_first = False

    def take_free(self):
        return bool(self.free_ids)

    def grow(self, seq, num_tokens):
        while len(seq.block_table) * self.kv_block_size < num_tokens:
            if self.take_free():
                block_id = self.free_ids.pop()
            else:
                block_id, _ = self.evictable.popitem(last=self.newest_first)
                block = self.blocks[block_id]
                del self.cached[block.hash]
                self.cache_version += 1
                block.hash, block.token_ids = None, ()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)


# WRONG: evicts the most recently given back cached block (LIFO), not the least recent
@blind_build("block_manager", "BlockManager", name="evict_newest", known="evicts_the_newest")
class EvictNewest(_BlindGrow):
    newest_first = True  # the mistake: was `evictable.popitem(last=False)`


# WRONG: grow evicts a cached block first when any exists, before taking a free one
@blind_build("block_manager", "BlockManager", name="grow_prefers_evictable")
class GrowPrefersEvictable(_BlindGrow):
    def take_free(self):
        # the mistake: was `return bool(self.free_ids)`
        return bool(self.free_ids) and not self.evictable


# WRONG: num_used sums ref counts: a block shared by two tables counts twice
@blind_build("block_manager", "BlockManager", name="num_used_sums_refcounts")
class NumUsedSumsRefcounts(_Blind):
    @property
    def num_used(self):
        # the mistake: was `return self.num_blocks - self.num_free - len(self.evictable)`
        return sum(block.ref_count for block in self.blocks)


# WRONG: release gives blocks back first block first (the prefix's start is evicted before
# its end)
@blind_build("block_manager", "BlockManager", name="release_first_block_first")
class ReleaseFirstBlockFirst(_Blind):
    def release(self, seq):
        for block_id in seq.block_table:  # the mistake: was `reversed(seq.block_table)`
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0


class _BlindAdvance(_Blind):
    """advance, keying blocks of `ids(seq)` up to `keyed_end(seq)` tokens, a block keyed
    when `free_to_key(block, key)`."""

    def ids(self, seq):
        return seq.all_ids

    def keyed_end(self, seq):
        return seq.num_computed_tokens

    def free_to_key(self, block, key):
        return block.hash is None and key not in self.cached

    def advance(self, seq, num_new):
        seq.num_computed_tokens += num_new
        if not self.enable_prefix_caching:
            return
        size = self.kv_block_size
        ids = self.ids(seq)
        while len(seq.block_hashes) < self.keyed_end(seq) // size:
            i = len(seq.block_hashes)
            tokens = tuple(ids[i * size : (i + 1) * size])
            key = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(key)
            block = self.blocks[seq.block_table[i]]
            if self.free_to_key(block, key):
                block.hash, block.token_ids = key, tokens
                self.cached[key] = block.block_id
                self.cache_version += 1


# WRONG: advance keys only blocks of the prompt; blocks filled by generated tokens never get
# keyed
@blind_build("block_manager", "BlockManager", name="register_prompt_only")
class RegisterPromptOnly(_BlindAdvance):
    def ids(self, seq):
        return seq.prompt_ids  # the mistake: was `seq.all_ids`

    def keyed_end(self, seq):
        # the mistake: was `return seq.num_computed_tokens`
        return min(seq.num_computed_tokens, len(seq.prompt_ids))


# WRONG: advance keys a block even when its key is cached already (the newer copy replaces
# the older in `cached`)
@blind_build("block_manager", "BlockManager", name="rekey_duplicate")
class RekeyDuplicate(_BlindAdvance):
    def free_to_key(self, block, key):
        return block.hash is None  # the mistake: `and key not in self.cached` left out


# -- build cached_loop: StaticLayer, StaticCache, generate_cached ------------------------------
# These run with the learner module's globals: StaticCache is whatever the module holds
# under that name (rose's own static cache while the loop is checked).

END_OF_TEXT = 50256


def _blind_loop(model, prompts, max_new_tokens, prefill_chunk=None, chunked=True, stops=()):
    """The reference's generate_cached; `chunked` False: the prefill in one call whatever
    prefill_chunk says; a row whose last token is in `stops` repeats it."""
    longest = max(len(prompt) for prompt in prompts)
    pads = [longest - len(prompt) for prompt in prompts]
    rows = [[0] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
    ids = torch.tensor(rows, device=model.lm_head.weight.device)
    cache = StaticCache(model, len(prompts), longest + max_new_tokens, pads)
    chunk = (prefill_chunk if chunked else None) or longest
    for start in range(0, longest, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache).logits[:, -1]
    new_tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        next_ids = logits.argmax(dim=-1)
        for r, row in enumerate(new_tokens):
            if row and row[-1] in stops:
                next_ids[r] = row[-1]
            row.append(int(next_ids[r]))
        if step + 1 < max_new_tokens:  # the last token is never fed back
            logits = model(next_ids[:, None], cache=cache).logits[:, -1]
    return new_tokens


# WRONG: each prompt decoded alone on a cache of its own (no batching)
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def cache_per_prompt(model, prompts, max_new_tokens, prefill_chunk=None):
    # the mistake: was `return _blind_loop(model, prompts, max_new_tokens, prefill_chunk)`
    return [_blind_loop(model, [p], max_new_tokens, prefill_chunk)[0] for p in prompts]


# WRONG: generate_cached prefills the whole prompt in one call whatever prefill_chunk says
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def ignores_prefill_chunk(model, prompts, max_new_tokens, prefill_chunk=None):
    # the mistake: the loop's `chunk = prefill_chunk or longest` was `chunk = longest`
    return _blind_loop(model, prompts, max_new_tokens, prefill_chunk, chunked=False)


# WRONG: a row stops at end-of-text (50256) and repeats it, though the contract says no
# stopping early
@blind_build("cached_loop", "generate_cached")
@torch.no_grad()
def stops_at_eot(model, prompts, max_new_tokens, prefill_chunk=None):
    stops = (END_OF_TEXT, model.config.vocab_size - 1)  # the mistake: no stop is right
    return _blind_loop(model, prompts, max_new_tokens, prefill_chunk, stops=stops)


# WRONG: buffers always float32 (model dtype ignored); writes cast by indexing
@blind_build("cached_loop", "StaticCache.__init__", name="float32_buffers")
def _float32_buffers_made(self, model, batch_size, max_len, pad_lengths=None):
    cfg = model.config
    weight = model.lm_head.weight
    shape = (batch_size, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
    self.layers = [
        # the mistake: was `torch.zeros(shape, dtype=weight.dtype, device=weight.device)`
        StaticLayer(
            torch.zeros(shape, device=weight.device), torch.zeros(shape, device=weight.device)
        )
        for _ in range(cfg.n_layer)
    ]
    self.max_len = max_len
    self.filled = 0
    self.input_pos = torch.zeros(0, dtype=torch.long, device=weight.device)
    self.pads = torch.tensor(pad_lengths or [0] * batch_size, device=weight.device)
    slots = torch.arange(max_len, device=weight.device)
    self.real = slots[None, :] >= self.pads[:, None]


@blind_build("cached_loop", "StaticLayer.update", name="float32_buffers")
def _float32_buffers_written(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v), returning self.k, self.v
    self.k[:, :, input_pos] = k.float()
    self.v[:, :, input_pos] = v.float()
    return self.k.to(k.dtype), self.v.to(v.dtype)


# WRONG: StaticLayer.update rebinds self.k/self.v to new tensors (index_copy, not
# index_copy_): the buffers given are never written
@blind_build("cached_loop", "StaticLayer.update")
def out_of_place_update(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v): the buffers written in place
    self.k = self.k.index_copy(2, input_pos, k)
    self.v = self.v.index_copy(2, input_pos, v)
    return self.k, self.v


# WRONG: only row 0 of the batch is written into the buffers
@blind_build("cached_loop", "StaticLayer.update", known="row_zero_only")
def row0_only_write(self, input_pos, k, v):
    # the mistake: was `self.k[:, :, input_pos] = k` (and v): every row
    self.k[0].index_copy_(1, input_pos, k[0])
    self.v[0].index_copy_(1, input_pos, v[0])
    return self.k, self.v


def _blind_prepare(self, batch, q_len, device, top_left=False, opened=True, padded=True):
    """The reference's prepare; `top_left`: query i sees slots 0..i; `opened` False: a
    padding query's row left all False; `padded` False: the positions are the slots'."""
    self.input_pos = torch.arange(self.filled, self.filled + q_len, device=device)
    self.filled += q_len
    slots = torch.arange(self.max_len, device=device)
    rows = torch.arange(q_len, device=device) if top_left else self.input_pos
    causal = slots[None, :] <= rows[:, None]
    mask = causal[None, None, :, :] & self.real[:, None, None, :]
    if opened:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    if not padded:
        return self.input_pos[None, :].expand(batch, q_len), mask
    return (self.input_pos[None, :] - self.pads[:, None]).clamp(min=0), mask


# WRONG: causal part of the mask aligned top-left (query i sees slots 0..i, ignoring the past)
@blind_build("cached_loop", "StaticCache.prepare", known="top_left_mask")
def mask_top_left(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, top_left=True)


# WRONG: a padding query's mask row is left all False (softmax over nothing: NaN)
@blind_build("cached_loop", "StaticCache.prepare")
def padding_rows_not_opened(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, opened=False)


# WRONG: positions are the slot numbers: left padding counted in the positions
@blind_build("cached_loop", "StaticCache.prepare", known="padding_counted")
def pos_counts_padding(self, batch, q_len, device):
    return _blind_prepare(self, batch, q_len, device, padded=False)


# -- build model: CausalSelfAttention, MLP, Block, GPT --------------------------------------


def _blind_attention(self, x, split_heads, merge_heads, scale):
    """The reference's attention forward, the heads cut by `split_heads(t, B, T, head_dim)`
    and put back by `merge_heads(y, B, T, C)`, the scores divided by `scale(C, head_dim)`."""
    B, T, C = x.shape
    head_dim = C // self.n_head
    q, k, v = (split_heads(t, B, T, head_dim) for t in self.c_attn(x).split(C, dim=2))
    scores = (q @ k.transpose(-2, -1)) / scale(C, head_dim)
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~allowed, float("-inf"))
    return self.c_proj(merge_heads(torch.softmax(scores, dim=-1) @ v, B, T, C))


def _heads_split(self, t, B, T, head_dim):
    return t.view(B, T, self.n_head, head_dim).transpose(1, 2)


def _heads_merged(y, B, T, C):
    return y.transpose(1, 2).contiguous().view(B, T, C)


# WRONG: heads split as view(B, T, head_dim, n_head): head h gets every n_head-th feature
@blind_build("model", "CausalSelfAttention.forward")
def heads_interleaved(self, x):
    def split(t, B, T, head_dim):
        # the mistake: was `t.view(B, T, self.n_head, head_dim).transpose(1, 2)`
        return t.view(B, T, head_dim, self.n_head).permute(0, 3, 1, 2)

    def merge(y, B, T, C):
        return y.permute(0, 2, 3, 1).contiguous().view(B, T, C)

    return _blind_attention(self, x, split, merge, lambda C, head_dim: math.sqrt(head_dim))


# WRONG: scores scaled by sqrt(n_embd) instead of sqrt(head_dim)
@blind_build("model", "CausalSelfAttention.forward")
def scale_sqrt_n_embd(self, x):
    def split(t, B, T, head_dim):
        return _heads_split(self, t, B, T, head_dim)

    # the mistake: was `math.sqrt(head_dim)`
    return _blind_attention(self, x, split, _heads_merged, lambda C, head_dim: math.sqrt(C))


# WRONG: MLP uses the exact erf GELU (F.gelu default), not GPT-2's tanh approximation
@blind_build("model", "MLP.forward", known="exact_gelu")
def erf_gelu(self, x):
    # the mistake: was `F.gelu(self.c_fc(x), approximate="tanh")`
    return self.c_proj(F.gelu(self.c_fc(x)))


# WRONG: Block normalises the MLP's input with ln_1 again (ln_2 created but never used)
@blind_build("model", "Block.forward")
def ln1_reused_for_mlp(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_1(x))  # the mistake: was `self.ln_2(x)`


def _blind_block_init(self, config, **norm):
    """The reference's Block.__init__, its LayerNorms made with `norm` in place of bias=."""
    nn.Module.__init__(self)
    self.ln_1 = nn.LayerNorm(config.n_embd, **norm)
    self.attn = CausalSelfAttention(config)
    self.ln_2 = nn.LayerNorm(config.n_embd, **norm)
    self.mlp = MLP(config)


def _blind_gpt_init(self, config, norm=None, tied=True):
    """The reference's GPT.__init__, ln_f made with `norm` (bias=config.bias when None);
    `tied` False: lm_head gets a copy of wte's weight, a Parameter of its own."""
    nn.Module.__init__(self)
    self.transformer = nn.ModuleDict(
        dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, **(norm or {"bias": config.bias})),
        )
    )
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    if tied:
        self.lm_head.weight = self.transformer.wte.weight
    else:
        self.lm_head.weight = nn.Parameter(self.transformer.wte.weight.detach().clone())


# WRONG: LayerNorms always get a bias (config.bias ignored for them)
@blind_build("model", "Block.__init__", name="ln_always_bias")
def _ln_always_bias_in_blocks(self, config):
    _blind_block_init(self, config)  # the mistake: was `bias=config.bias`


@blind_build("model", "GPT.__init__", name="ln_always_bias")
def _ln_always_bias_at_the_end(self, config):
    _blind_gpt_init(self, config, norm={})  # the mistake: ln_f was given `bias=config.bias`


# WRONG: LayerNorm eps 1e-6 (TF-style) instead of PyTorch's/GPT-2's 1e-5
@blind_build("model", "Block.__init__", name="ln_eps_1e6")
def _ln_eps_1e6_in_blocks(self, config):
    _blind_block_init(self, config, eps=1e-6, bias=config.bias)  # the mistake: eps=1e-6


@blind_build("model", "GPT.__init__", name="ln_eps_1e6")
def _ln_eps_1e6_at_the_end(self, config):
    _blind_gpt_init(self, config, norm={"eps": 1e-6, "bias": config.bias})  # (the mistake)


# WRONG: lm_head gets its own Parameter (a copy of wte's weight), not tied: same forward,
# wrong gradients
@blind_build("model", "GPT.__init__", known="untied_head")
def untied_head_copy(self, config):
    _blind_gpt_init(self, config, tied=False)  # the mistake: was lm_head.weight = wte.weight


# WRONG: positions built with torch.arange(T) on the CPU whatever idx's device (breaks on a
# GPU)
@blind_build("model", "GPT.forward")
def pos_no_device(self, idx):
    positions = torch.arange(idx.size(1))  # the mistake: was `device=idx.device`
    x = self.transformer.wte(idx) + self.transformer.wpe(positions)
    for block in self.transformer.h:
        x = block(x)
    return self.lm_head(self.transformer.ln_f(x))


# -- build training_step: AdamW, parameter_groups, learning_rate, clip_gradients, train_step


def _blind_adam_step(self, decay_first=True, settings=None, eps_inside=False, step_of=None):
    """The reference's AdamW.step; `settings(group)`: (betas, eps) (the group's own by
    default); `step_of(state)`: the step count the bias correction uses (the parameter's
    own, bumped here, by default)."""
    for group in self.param_groups:
        lr, wd = group["lr"], group["weight_decay"]
        (beta1, beta2), eps = (settings or (lambda g: (g["betas"], g["eps"])))(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
            state["t"] += 1
            t = state["t"] if step_of is None else step_of(state)
            m, v, grad = state["m"], state["v"], p.grad
            if decay_first:
                p.mul_(1 - lr * wd)
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(lr * m_hat / ((v_hat + eps).sqrt() if eps_inside else v_hat.sqrt() + eps))
            if not decay_first:
                p.mul_(1 - lr * wd)


# WRONG: decoupled decay applied after the Adam update (shrinks the updated parameter)
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def decay_after_adam(self):
    _blind_adam_step(self, decay_first=False)  # the mistake: `p.mul_(1 - lr * wd)` moved


# WRONG: betas and eps read from the optimizer's defaults, ignoring a group's own
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def defaults_betas_eps(self):
    # the mistake: was `group["betas"], group["eps"]`
    _blind_adam_step(self, settings=lambda group: (self.defaults["betas"], self.defaults["eps"]))


# WRONG: eps added inside the square root: sqrt(v_hat + eps)
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def eps_inside_sqrt(self):
    _blind_adam_step(self, eps_inside=True)  # the mistake: was `v_hat.sqrt() + eps`


# WRONG: one step counter for the whole optimizer (bumped every step()), not per parameter:
# a parameter that skipped a step gets the wrong bias correction
@blind_build("training_step", "AdamW.step")
@torch.no_grad()
def shared_step_counter(self):
    self.steps_taken = getattr(self, "steps_taken", 0) + 1  # the mistake: one count for all
    _blind_adam_step(self, step_of=lambda state: self.steps_taken)


def _blind_groups(model, weight_decay, decays, frozen_too=False):
    """The reference's groups, a parameter decayed when `decays(name, p)`."""
    named = [(n, p) for n, p in model.named_parameters() if frozen_too or p.requires_grad]
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


# WRONG: groups by name: everything not named '*bias' decays, so LayerNorm weights decay too
@blind_build("training_step", "parameter_groups", known="decay_on_layernorm")
def decay_by_name(model, weight_decay):
    # the mistake: was `decays=lambda name, p: p.dim() >= 2`
    return _blind_groups(model, weight_decay, lambda name, p: not name.endswith("bias"))


# WRONG: parameter_groups keeps parameters that do not require a gradient (frozen ones get
# optimised/decayed)
@blind_build("training_step", "parameter_groups")
def frozen_params_grouped(model, weight_decay):
    # the mistake: the frozen parameters (requires_grad False) grouped too
    return _blind_groups(model, weight_decay, lambda name, p: p.dim() >= 2, frozen_too=True)


def _blind_rate(step, cfg, decay_steps, warmup_from=1):
    """The reference's learning_rate, decaying to `decay_steps`, the warmup's first step at
    `warmup_from` / warmup_steps of the rate."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + warmup_from) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        cfg.learning_rate - cfg.min_lr
    )


# WRONG: cosine always ends at max_steps, lr_decay_steps ignored
@blind_build("training_step", "learning_rate")
def ignores_lr_decay_steps(step, cfg):
    return _blind_rate(step, cfg, cfg.max_steps)  # the mistake: was `cfg.lr_decay_steps or ...`


# WRONG: warmup starts at rate 0 at step 0 (step / warmup_steps), off by one
@blind_build("training_step", "learning_rate", known="schedule_one_step_off")
def warmup_from_zero(step, cfg):
    # the mistake: was `(step + 1) / cfg.warmup_steps` in the warmup
    return _blind_rate(step, cfg, cfg.lr_decay_steps or cfg.max_steps, warmup_from=0)


def _blind_norm(grads) -> float:
    return torch.stack([g.norm() for g in grads]).norm().item()


def _blind_clip(parameters, max_norm, norm_of=_blind_norm):
    """The reference's clip_gradients, the gradients' norm as `norm_of(grads)` says."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = norm_of(grads)
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return norm


# WRONG: global norm computed as the sum of each gradient's L2 norm
@blind_build("training_step", "clip_gradients")
def clip_sum_of_norms(parameters, max_norm):
    # the mistake: was the norm of the norms
    return _blind_clip(parameters, max_norm, lambda grads: sum(g.norm().item() for g in grads))


# WRONG: clip_gradients iterates `parameters` twice (a generator is empty the 2nd time, so
# nothing is clipped); train_step happens to pass a list
@blind_build("training_step", "clip_gradients", name="clip_iterates_twice_list")
def _clip_iterating_twice(parameters, max_norm):
    norm = _blind_norm([p.grad for p in parameters if p.grad is not None])
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p in parameters:  # the mistake: `parameters` read again (a generator is spent)
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _blind_train_step(
    model,
    optimizer,
    batches,
    step,
    cfg,
    first_group_only=False,
    last_loss=False,
    zero_clips=False,
    cleared_first=False,
    as_list=False,
):
    """The reference's train_step, with the mistakes its arguments name."""
    if cleared_first:
        optimizer.zero_grad(set_to_none=True)
    groups = optimizer.param_groups[:1] if first_group_only else optimizer.param_groups
    for group in groups:
        group["lr"] = learning_rate(step, cfg)
    total = 0.0
    for _ in range(cfg.grad_accum_steps):
        x, y = next(batches)
        loss = model(x, y).loss / cfg.grad_accum_steps
        loss.backward()
        total = loss.item() * cfg.grad_accum_steps if last_loss else total + loss.item()
    max_norm = cfg.grad_clip if zero_clips or cfg.grad_clip > 0 else math.inf
    parameters = list(model.parameters()) if as_list else model.parameters()
    norm = clip_gradients(parameters, max_norm)
    optimizer.step()
    if not cleared_first:
        optimizer.zero_grad(set_to_none=True)
    return total, norm


@blind_build("training_step", "train_step", name="clip_iterates_twice_list")
def _clip_given_a_list(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, as_list=True)


# WRONG: grad_clip 0 passed straight to clipping (every gradient zeroed) instead of meaning
# 'no clipping'
@blind_build("training_step", "train_step")
def clip_zero_clips(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, zero_clips=True)


# WRONG: gradients cleared at the start of train_step instead of after the optimizer step
# (left set on return)
@blind_build("training_step", "train_step")
def grads_cleared_first(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, cleared_first=True)


# WRONG: returns the last micro-batch's loss (unscaled), not the mean over micro-batches
@blind_build("training_step", "train_step")
def loss_last_micro(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, last_loss=True)


# WRONG: the schedule's rate is set on the first parameter group only
@blind_build("training_step", "train_step")
def lr_first_group_only(model, optimizer, batches, step, cfg):
    return _blind_train_step(model, optimizer, batches, step, cfg, first_group_only=True)


# -- build verify: RollbackCache, verify_greedy, accept_or_resample, verify_sampled ----------
# These run with the learner module's globals: score, accept_or_resample.


# WRONG: RollbackCache mask aligned top-left: new query i sees keys 0..i only
@blind_build("verify", "RollbackCache.prepare", name="mask_top_left")
def _rollback_mask_top_left(self, batch, q_len, device):
    past, kv_len = self.seq_len, self.seq_len + q_len
    query_pos = torch.arange(past, kv_len, device=device)
    key_pos = torch.arange(kv_len, device=device)
    # the mistake: was `key_pos[None, :] <= query_pos[:, None]`
    return query_pos[None, :], key_pos[None, :] <= torch.arange(q_len, device=device)[:, None]


# WRONG: truncate moves the length counter back but leaves the layers' tensors long
@blind_build("verify", "RollbackCache", name="truncate_counter_only")
class TruncateCounterOnly:
    """The writer's cache, which counts its length itself."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._len = 0

    @property
    def seq_len(self) -> int:
        return self._len

    def prepare(self, batch, q_len, device):
        past, kv = self._len, self._len + q_len
        qpos = torch.arange(past, kv, device=device)
        self._len = kv
        return qpos[None, :], torch.arange(kv, device=device)[None, :] <= qpos[:, None]

    def update(self, layer, k, v):
        if layer < len(self.layers):
            pk, pv = self.layers[layer]
            self.layers[layer] = (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
        else:
            self.layers.append((k, v))
        return self.layers[layer]

    def truncate(self, n: int) -> None:
        # the mistake: `self.layers = [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]`
        # left out
        self._len = n


def _blind_greedy(target, cache, last_token, drafts, kept_on_rejection=1, bonus=True):
    """The writer's greedy verify: on a rejection at draft i the cache keeps held +
    `kept_on_rejection` + i positions; `bonus` False: all drafts kept, no token after them."""
    held = cache.seq_len
    choices = score(target, cache, last_token, drafts).argmax(dim=-1).tolist()
    for i, drafted in enumerate(drafts):
        if drafted != choices[i]:
            cache.truncate(held + kept_on_rejection + i)
            return [*drafts[:i], choices[i]]
    cache.truncate(held + 1 + len(drafts))
    return [*drafts, choices[len(drafts)]] if bonus else list(drafts)


# WRONG: greedy verify returns only the drafts when all are kept (no bonus token)
@blind_build("verify", "verify_greedy")
@torch.no_grad()
def greedy_no_bonus(target, cache, last_token, drafts):
    return _blind_greedy(target, cache, last_token, drafts, bonus=False)


# WRONG: greedy rollback keeps held + i on a rejection: last_token's key is dropped too
@blind_build("verify", "verify_greedy")
@torch.no_grad()
def greedy_truncate_forgets_last(target, cache, last_token, drafts):
    # the mistake: was `held + 1 + i` on a rejection
    return _blind_greedy(target, cache, last_token, drafts, kept_on_rejection=0)


def _blind_rule(p, q, drafted, generator, uniform=None, kept=None, residual_of=None):
    """The reference's accept_or_resample: the draft kept when `kept(u, p, q)` (u < p / q by
    default, u drawn by `uniform()`, from `generator` by default), else a token drawn from
    `residual_of(p, q)` (max(0, p - q) by default)."""
    u = torch.rand((), generator=generator) if uniform is None else uniform()
    if (kept or (lambda u, p, q: u * q[drafted] < p[drafted]))(u, p, q):
        return drafted, True
    residual = (p - q).clamp(min=0) if residual_of is None else residual_of(p, q)
    if float(residual.sum()) <= 0:
        residual = p
    token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(token), False


# WRONG: draft kept exactly when p(x) >= q(x) (no uniform draw), else resampled
@blind_build("verify", "accept_or_resample")
def deterministic_accept(p, q, drafted, generator):
    # the mistake: was `u * q[drafted] < p[drafted]`, u drawn from generator
    return _blind_rule(p, q, drafted, generator, kept=lambda u, p, q: p[drafted] >= q[drafted])


# WRONG: the acceptance uniform comes from the global RNG (torch.rand without the generator)
@blind_build("verify", "accept_or_resample")
def global_rng_u(p, q, drafted, generator):
    # the mistake: was `torch.rand((), generator=generator)`
    return _blind_rule(p, q, drafted, generator, uniform=lambda: torch.rand(()))


# WRONG: on rejection the token is drawn from p, not from the residual max(0, p - q)
@blind_build("verify", "accept_or_resample", known="no_residual")
def resample_from_p(p, q, drafted, generator):
    # the mistake: was `(p - q).clamp(min=0)`
    return _blind_rule(p, q, drafted, generator, residual_of=lambda p, q: p)


def _blind_sampled(
    target,
    cache,
    last_token,
    drafts,
    draft_probs,
    generator,
    row_shift=0,
    bonus_row=0,
    greedy_bonus=False,
    rollback=True,
):
    """The reference's sampled verify: draft i against the target's row i + `row_shift`,
    the bonus from row len(drafts) + `bonus_row` (its argmax if `greedy_bonus`), the cache
    rolled back after a rejection if `rollback`."""
    held = cache.seq_len
    p = torch.softmax(score(target, cache, last_token, drafts), dim=-1)
    tokens = []
    for i, drafted in enumerate(drafts):
        row = p[i + row_shift]
        token, kept = accept_or_resample(row, draft_probs[i].float(), drafted, generator)
        tokens.append(token)
        if not kept:
            if rollback:
                cache.truncate(held + len(tokens))
            return tokens
    last = p[len(drafts) + bonus_row]
    bonus = last.argmax() if greedy_bonus else torch.multinomial(last, 1, generator=generator)
    tokens.append(int(bonus))
    cache.truncate(held + len(tokens))
    return tokens


# WRONG: sampled verify takes the bonus token greedily (argmax), not drawn from p
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def bonus_argmax(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `torch.multinomial(p[len(drafts)], 1, generator=generator)`
    return _blind_sampled(
        target, cache, last_token, drafts, draft_probs, generator, greedy_bonus=True
    )


# WRONG: sampled bonus drawn from the last draft's row (probs[k-1]), off by one
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def bonus_wrong_row(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `p[len(drafts)]`
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, bonus_row=-1)


# WRONG: sampled verify never truncates the cache after a rejection
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def sampled_no_rollback(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: `cache.truncate(held + len(tokens))` left out on a rejection
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, rollback=False)


# WRONG: sampled verify compares draft i with the target's row i + 1 (the row after it)
@blind_build("verify", "verify_sampled")
@torch.no_grad()
def sampled_q_from_p_row_shift(target, cache, last_token, drafts, draft_probs, generator):
    # the mistake: was `p[i]`
    return _blind_sampled(target, cache, last_token, drafts, draft_probs, generator, row_shift=1)
