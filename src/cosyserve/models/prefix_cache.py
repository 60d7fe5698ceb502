"""Reuse of LM prefill work across requests that start with the same input.

Every LM input is ``[sos] + prompt_text_ids + text_ids + [task_id] + prompt_speech``, so
requests of one voice share the keys and values of ``[sos] + prompt_text_ids`` (and
requests of the same voice and text share almost everything). The cache keeps keys and
values of recently prefilled inputs in blocks of ``block_size`` positions, each block
keyed by its own ids and the block before it, so a block matches only when the whole
input up to its end matches (keys and values at a position depend on every earlier one).

Memory is fixed: a pool of ``max_blocks`` blocks is allocated once and recycled least
recently used first. A block is always touched after the blocks it continues, so the
least recently used block is never one that a more recent block depends on.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cosyserve.modeldir.hparams import Qwen2Config
from cosyserve.models.kv_cache import KVCache

# Ids of the LM input positions that are not text tokens, in one id space with them:
# text ids are >= 0, sos and task_id are -1 and -2, speech token s is -3 - s.
SOS_ID = -1
TASK_ID = -2
_SPEECH_BASE = -3

_ROOT = 0  # the parent id of a first block


def lm_input_ids(text_ids: Sequence[int], prompt_speech: Sequence[int]) -> tuple[int, ...]:
    """The key of the LM input ``[sos] + text_ids + [task_id] + prompt_speech``: one id per
    position, text and speech tokens kept apart."""
    return (SOS_ID, *text_ids, TASK_ID, *(_SPEECH_BASE - s for s in prompt_speech))


@dataclass(frozen=True)
class _Block:
    id: int  # never reused, so a block whose parent was evicted can never match again
    row: int  # its place in the pool


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made."""

    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    reused_positions: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Keys and values of up to ``max_blocks`` blocks of ``block_size`` LM positions.

    ``k``, ``v``: (layers, max_blocks, block_size, H_kv, D). Not thread-safe: the engine
    thread alone uses it.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_blocks: int,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim, max_blocks, block_size) < 1:
            raise ValueError("PrefixCache dimensions must all be positive")
        shape = (num_layers, max_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.stats = PrefixCacheStats()
        # (parent block id, the block's ids) -> block, least recently used first.
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()
        self._free_rows = list(range(max_blocks - 1, -1, -1))
        self._next_id = _ROOT + 1

    @classmethod
    def for_config(
        cls,
        cfg: Qwen2Config,
        max_positions: int,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "PrefixCache":
        """A cache for the Qwen2 backbone ``cfg`` holding ``max_positions`` positions."""
        return cls(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            max(1, max_positions // block_size),
            block_size,
            dtype,
            device,
        )

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        """Memory of the pool (allocated once, whatever the cache holds)."""
        return self.k.nbytes + self.v.nbytes

    def restore(self, ids: Sequence[int], cache: KVCache, slot: int, limit: int) -> int:
        """Load the longest cached run of whole blocks that starts ``ids`` (at most
        ``limit`` positions) into the empty ``slot``. Returns the positions loaded."""
        self.stats.lookups += 1
        keys = self._cached_chain(ids, min(len(ids), limit) // self.block_size)
        if not keys:
            return 0
        self._touch(keys)
        rows = torch.tensor([self._blocks[key].row for key in keys], device=self.k.device)
        n = len(keys) * self.block_size
        layers, _, _, kv_heads, head_dim = self.k.shape
        k = self.k[:, rows].reshape(layers, n, kv_heads, head_dim)
        v = self.v[:, rows].reshape(layers, n, kv_heads, head_dim)
        cache.load_prefix(slot, k, v)
        self.stats.hits += 1
        self.stats.reused_positions += n
        return n

    def store(self, ids: Sequence[int], cache: KVCache, slot: int) -> None:
        """Keep the whole blocks of ``ids``, whose keys and values ``slot`` holds from
        position 0, evicting the least recently used blocks to make room."""
        n_blocks = min(len(ids), cache.length(slot)) // self.block_size
        n_blocks = min(n_blocks, self.max_blocks)
        keys: list[tuple[int, tuple[int, ...]]] = []
        new_rows: list[int] = []
        new_blocks: list[int] = []
        parent = _ROOT
        for i in range(n_blocks):
            key = (parent, tuple(ids[i * self.block_size : (i + 1) * self.block_size]))
            block = self._blocks.get(key)
            if block is None:
                block = _Block(self._next_id, self._take_row())
                self._next_id += 1
                self._blocks[key] = block
                new_rows.append(block.row)
                new_blocks.append(i)
            else:
                # Most recent for now, so that making room for the next blocks of this
                # input never evicts the blocks they continue.
                self._blocks.move_to_end(key)
            keys.append(key)
            parent = block.id
        self._touch(keys)
        if not new_rows:
            return
        span = n_blocks * self.block_size
        slot_k, slot_v = cache.read(slot, 0, span)  # (layers, span, H_kv, D)
        rows = torch.tensor(new_rows, device=self.k.device)
        blocks = torch.tensor(new_blocks, device=self.k.device)
        shape = (slot_k.shape[0], n_blocks, self.block_size, *slot_k.shape[2:])
        self.k[:, rows] = slot_k.reshape(shape)[:, blocks].to(self.k.dtype)
        self.v[:, rows] = slot_v.reshape(shape)[:, blocks].to(self.v.dtype)
        self.stats.stored_blocks += len(new_rows)

    def clear(self) -> None:
        """Forget every block (the pool stays allocated)."""
        self._blocks.clear()
        self._free_rows = list(range(self.max_blocks - 1, -1, -1))

    def _cached_chain(self, ids: Sequence[int], n_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        keys = []
        parent = _ROOT
        for i in range(n_blocks):
            key = (parent, tuple(ids[i * self.block_size : (i + 1) * self.block_size]))
            block = self._blocks.get(key)
            if block is None:
                break
            keys.append(key)
            parent = block.id
        return keys

    def _touch(self, keys: list[tuple[int, tuple[int, ...]]]) -> None:
        # Last block first: every block ends up more recent than the blocks continuing it.
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def _take_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        _, evicted = self._blocks.popitem(last=False)
        self.stats.evicted_blocks += 1
        return evicted.row
