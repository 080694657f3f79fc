"""Which prefill TP ranks feed which decode TP rank, and where decode listens.

Prefill may run a larger TP than decode (p_tp = ratio * d_tp). The ``ratio``
prefill ranks of one group all feed one decode rank. Main KV (MLA latent) is
replicated across TP, so member 0 of the group alone sends it; the indexer
cache is split into disjoint contiguous block ranges, one per member, so the
copy work is shared and the union is the whole request. A member whose range
is empty still sends (and gets acknowledged for) its item, so decode can count
contributors without knowing how many blocks each one had.
"""

from __future__ import annotations

from dataclasses import dataclass

from ascend_offload.errors import AscendOffloadError


class TopologyError(AscendOffloadError, ValueError):
    """Prefill/decode sizes that cannot be paired; raised at startup."""


@dataclass(frozen=True)
class Topology:
    p_tp: int
    d_tp: int

    def __post_init__(self) -> None:
        if self.p_tp < 1 or self.d_tp < 1:
            raise TopologyError(f"prefill tp={self.p_tp}, decode tp={self.d_tp}: both must be >= 1")
        if self.p_tp < self.d_tp or self.p_tp % self.d_tp:
            raise TopologyError(
                f"unsupported P/D topology: prefill tp={self.p_tp}, decode tp={self.d_tp} "
                "(needs prefill tp >= decode tp and prefill tp divisible by decode tp)"
            )

    @property
    def ratio(self) -> int:
        return self.p_tp // self.d_tp

    def _check_p(self, p_rank: int) -> None:
        if not 0 <= p_rank < self.p_tp:
            raise TopologyError(f"prefill rank {p_rank} outside 0..{self.p_tp - 1}")

    def d_rank_of(self, p_rank: int) -> int:
        self._check_p(p_rank)
        return p_rank // self.ratio

    def member_of(self, p_rank: int) -> int:
        self._check_p(p_rank)
        return p_rank % self.ratio

    def contributors(self, d_rank: int) -> range:
        """Prefill ranks that feed decode rank ``d_rank``."""
        if not 0 <= d_rank < self.d_tp:
            raise TopologyError(f"decode rank {d_rank} outside 0..{self.d_tp - 1}")
        return range(d_rank * self.ratio, (d_rank + 1) * self.ratio)

    def sends_main(self, p_rank: int) -> bool:
        return self.member_of(p_rank) == 0

    def index_range(self, p_rank: int, num_blocks: int) -> tuple[int, int]:
        """This member's ``[lo, hi)`` share of a request's ``num_blocks`` indexer blocks.

        Balanced contiguous split: the first ``num_blocks % ratio`` members take
        one extra block. Empty (lo == hi) when there are fewer blocks than members.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 0")
        m, r = self.member_of(p_rank), self.ratio
        base, extra = divmod(num_blocks, r)
        lo = m * base + min(m, extra)
        return lo, lo + base + (1 if m < extra else 0)


def decode_port(kv_port: int, *, dp_rank: int, d_tp: int, tp_rank: int) -> int:
    """ZMQ port of one decode TP rank: ``kv_port + dp_rank * d_tp + tp_rank``."""
    if not 0 <= tp_rank < d_tp:
        raise TopologyError(f"decode tp_rank={tp_rank} outside 0..{d_tp - 1}")
    if dp_rank < 0:
        raise TopologyError(f"dp_rank={dp_rank}: must be >= 0")
    port = kv_port + dp_rank * d_tp + tp_rank
    if not 0 < port < 65536:
        raise TopologyError(
            f"decode port {port} (kv_port={kv_port}, dp_rank={dp_rank}, d_tp={d_tp}, "
            f"tp_rank={tp_rank}) is not a valid TCP port"
        )
    return port
