"""Which tensor-parallel ranks run on which node: node n holds ranks n*R .. n*R+R-1 (R ranks a
node), and a rank's device on its node is its local rank."""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.config import EngineConfig


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int
    ranks_per_node: int

    @classmethod
    def of(cls, config: EngineConfig) -> NodeLayout:
        return cls(config.nnodes, config.tp_size // config.nnodes)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def ranks_on(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def name(self, rank: int) -> str:
        """``rank 3 (node 1)``: how logs and errors name a rank."""
        return f"rank {rank} (node {self.node_of(rank)})"

    def names(self, ranks: list[int]) -> str:
        return ", ".join(self.name(r) for r in ranks)
