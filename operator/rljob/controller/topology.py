"""Where each pod of the gang stands: its engine instance, its node rank inside it, and its place in the
one trainer world; and the env that tells its containers. Pure: the names come from children.py.

`replicas` pods form `replicas // pods_per_instance` engine instances; pod `i` is node rank
`i % pods_per_instance` of instance `i // pods_per_instance`. In a multi-node engine instance only node
rank 0 serves the engine's API (agent/follower.py), so the operator sends the engine's lifecycle commands
to the instance's leader.

The trainer containers of all pods are one torch.distributed world, by the conventions users already
know: MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK (torch.distributed's env:// init) when each pod
runs one trainer process, and torchrun's PET_* variables (torchrun reads `--nnodes` etc. from
PET_NNODES, PET_NODE_RANK, ...) always, so `torchrun` with no arguments starts the right world. The
master is pod 0, by its stable DNS name (the headless Service's pod names).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PodPlace:
    index: int
    instance: int
    node_rank: int  # inside its engine instance; 0 is the leader (runs the engine's HTTP server)
    leader_index: int

    @property
    def leader(self) -> bool:
        return self.node_rank == 0


@dataclass(frozen=True)
class Topology:
    job: str
    namespace: str
    replicas: int
    pods_per_instance: int = 1
    trainer_processes_per_pod: int = 1
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.pods_per_instance < 1 or self.replicas % self.pods_per_instance:
            raise ValueError(
                f"replicas ({self.replicas}) must be a positive multiple of podsPerInstance "
                f"({self.pods_per_instance})"
            )

    @property
    def instances(self) -> int:
        return self.replicas // self.pods_per_instance

    def place(self, index: int) -> PodPlace:
        if not 0 <= index < self.replicas:
            raise IndexError(index)
        instance, node_rank = divmod(index, self.pods_per_instance)
        return PodPlace(index, instance, node_rank, instance * self.pods_per_instance)

    def members(self, instance: int) -> list[int]:
        first = instance * self.pods_per_instance
        return list(range(first, first + self.pods_per_instance))

    def dns_name(self, index: int) -> str:
        """The pod's stable name: hostname `JOB-i` under the headless Service `JOB` (subdomain)."""
        return f"{self.job}-{index}.{self.job}.{self.namespace}.svc"

    # --- env ---------------------------------------------------------------------------------------

    def instance_env(self, index: int) -> dict[str, str]:
        """For every container of the pod (usable in args as $(VAR)): where its engine instance is."""
        p = self.place(index)
        return {
            "RLJOB_INSTANCE": str(p.instance),
            "RLJOB_INSTANCES": str(self.instances),
            "RLJOB_NODE_RANK": str(p.node_rank),
            "RLJOB_NODES_PER_INSTANCE": str(self.pods_per_instance),
            "RLJOB_INSTANCE_LEADER": self.dns_name(p.leader_index),
        }

    def trainer_env(self, index: int) -> dict[str, str]:
        """For the trainer container: the rendezvous of the one trainer world."""
        nproc = self.trainer_processes_per_pod
        master = self.dns_name(0)
        env = {
            "MASTER_ADDR": master,
            "MASTER_PORT": str(self.master_port),
            "NNODES": str(self.replicas),
            "NODE_RANK": str(index),
            "NPROC_PER_NODE": str(nproc),
            "PET_NNODES": str(self.replicas),
            "PET_NODE_RANK": str(index),
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": str(self.master_port),
        }
        if nproc == 1:  # one process per pod: env:// init works without torchrun
            env |= {"WORLD_SIZE": str(self.replicas), "RANK": str(index), "LOCAL_RANK": "0"}
        return env
