"""Data-parallel training under torchrun: one process per rank, each running the same captured step.

`torchrun --standalone --nproc-per-node N -m remat finetune ...` starts N processes with RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and a rendezvous (MASTER_ADDR/PORT) in their environment;
`group()` reads them and joins a `torch.distributed` process group (gloo for CPU tensors, NCCL for
CUDA ones). Without them (or with WORLD_SIZE 1) everything here is the identity: one process trains
exactly as before. A caller that already joined a group (a test, a notebook) keeps its group.

The choices, and why:

- **The global batch is `--batch`**, split across ranks: rank r takes windows
  `[r * batch/N, (r+1) * batch/N)` of each batch the 1-process run would take (same seed, same
  order), so an N-process run trains on the same data as a 1-process one and, up to float summation
  order, gives the same losses. `--batch` must be a multiple of N. Each rank traces its step at
  `batch/N` windows (`Ranks.local`).
- **Token-weighted all-reduce**: the step's loss is the mean over a rank's targets. Rank r's loss
  and grads are weighted by `n_r / n` (its targets over the global batch's, both known on every rank
  since every rank holds the whole batch) and summed across ranks (`Part.weigh`, `Ranks.all_reduce`),
  which is the 1-process mean over the global batch. Gloo's and NCCL's ring reductions give every
  rank the same bits, so every rank steps the same way.
- **Optimizer state: `ZeroRedundancyOptimizer` (ZeRO-1) around AdamW**, not FSDP2's `fully_shard`.
  `fully_shard` shards the parameters themselves as DTensors and all-gathers them in module
  forward hooks, with its gradient reduce-scatter in autograd hooks; the captured step takes plain
  parameter tensors as placeholders and carries its own backward (no autograd, no module hooks run),
  so none of FSDP's machinery would fire. ZeRO only needs `p.grad` on every rank: each rank steps its
  own partition of the parameters (whole tensors, largest first to the least-loaded rank) and
  broadcasts the updated values. Per rank, the optimizer state is that partition:
  `plan.zero_shards` reproduces it, so the plan and the gate count each rank's share.
- **Checkpoints: consolidated on rank 0**, in the same files as a 1-process checkpoint (one writer,
  the same all-or-nothing rename, one file any rank can load). The consolidated copy is dropped
  after the save, so rank 0 holds the full optimizer state only while it writes. The RNG states of
  all ranks are stacked in `rng.pt` and `trainer_state.json` records the world size: a checkpoint
  resumes on the same N. Every rank reads `--resume` (and `--data`): on several machines it must be
  on a shared file system.
- **Failures**: a collective waits at most `--dist-timeout` seconds; a rank that raises leaves the
  group at once (its sockets close), so the others' next collective fails within moments instead of
  hanging; they stop with `PeerFailed` (one line, exit 1), leaving their broken group as it is. A
  process that joined a group ends without the interpreter's teardown (`cli.run`): torch's distributed
  objects destroyed at exit could abort it (std::terminate). Under torchrun the agent also stops the
  other workers when one fails.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from remat.base.settings import RematError, TrainSettings, UsageError, one_line
from remat.core import devices
from remat.training import checkpoints

BUCKET_BYTES = 32 << 20  # grads are all-reduced in flat buckets of about this size


class PeerFailed(RematError):
    """Another process of a data-parallel run failed, left, or did not answer within the timeout."""

    exit_code = 1


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank, world size, and the processes sharing its machine."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes outputs, checkpoints and the receipt, and shows progress."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def local(self, s: TrainSettings) -> TrainSettings:
        """The settings one rank traces and runs: its share of the global `--batch`."""
        if s.batch % self.world_size:
            raise UsageError(f"--batch {s.batch} does not split over {self.world_size} processes: "
                             f"the global batch must be a multiple of {self.world_size}")
        return s.model_copy(update={"batch": s.batch // self.world_size}) if self.parallel else s

    def budget(self, free: int) -> int:
        """This rank's share of a machine's free memory (the processes on one machine share it)."""
        return free // self.local_world_size

    def seed(self, seed: int) -> None:
        """Once the model is built (the same on every rank): a stream of random numbers per rank (dropout)."""
        if self.parallel:
            torch.manual_seed((seed * 1_000_003 + self.rank) % (1 << 63))

    def part(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Part:
        """This rank's windows of a global batch, and its share of the batch's targets."""
        if not self.parallel:
            return Part(input_ids, labels, 1.0)
        n = len(input_ids) // self.world_size
        rows = slice(self.rank * n, (self.rank + 1) * n)
        total = int((labels != -100).sum())
        ours = int((labels[rows] != -100).sum())
        return Part(input_ids[rows], labels[rows], ours / total if total else 0.0)

    def all_reduce(self, loss: float, grads: list[torch.Tensor]) -> float:
        """Sum the (weighted) loss and grads over ranks, in place: the global batch's token-weighted mean."""
        if not self.parallel:
            return loss
        with _collective(self):
            for bucket in _buckets(grads):
                flat = torch._utils._flatten_dense_tensors(bucket)
                dist.all_reduce(flat)
                for g, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                    g.copy_(reduced)
            total = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(total)
        return total.item()

    def optimizer(self, params: list[torch.Tensor], *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """AdamW; with several ranks its state sharded across them (ZeRO-1, see the module's docstring)."""
        fused = devices.optimizer_options(params[0].device)  # a device's AdamW: in place, one kernel (the plan's)
        if not self.parallel:
            return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **fused)
        from torch.distributed.optim import ZeroRedundancyOptimizer  # a second to import: only ranks pay it

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr, weight_decay=weight_decay,
                                       **fused)

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> list[int]:
        """Bytes of the optimizer state tensors each rank really holds, rank by rank."""
        local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard, or AdamW
        held = sum(t.untyped_storage().nbytes() for state in local.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor))
        if not self.parallel:
            return [held]
        everyone: list[int] = [0] * self.world_size
        with _collective(self):
            dist.all_gather_object(everyone, held)
        return everyone

    def save_checkpoint(self, out: Path, step: int, trainable: dict[str, torch.Tensor],
                        optimizer: torch.optim.Optimizer, losses: list[float], chosen: dict | None = None) -> Path:
        """Every rank calls this; rank 0 writes one checkpoint holding the whole optimizer state."""
        if not self.parallel:
            return checkpoints.save(out, step, trainable, optimizer, losses, chosen=chosen)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        rngs: list[torch.Tensor] = [torch.empty(0)] * self.world_size
        with _collective(self):
            optimizer.consolidate_state_dict(to=0)
            dist.all_gather_object(rngs, torch.get_rng_state())
        path = out / f"checkpoint-{step}"
        if self.is_main:
            path = checkpoints.save(out, step, trainable, optimizer, losses, rng=torch.stack(rngs),
                                    world_size=self.world_size, chosen=chosen)
            optimizer._all_state_dicts = []  # type: ignore[attr-defined]  # drop the consolidated copy: rank 0 is back to its share
        with _collective(self):
            dist.barrier()  # the checkpoint is whole before any rank goes on (or reports it)
        return path


ONE = Ranks()  # one process, no group


@dataclass
class Part:
    """One rank's windows of a global batch and `weight`: its targets over the global batch's."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    weight: float

    def weigh(self, loss: float, grads: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        """The step's (mean over this rank's targets) loss and grads, scaled to their share of the global mean."""
        if self.weight == 1.0:
            return loss, grads
        if self.weight == 0.0:  # no targets here: the mean is 0/0, its share nothing
            return 0.0, [g.zero_() for g in grads]
        return loss * self.weight, [g.mul_(self.weight) for g in grads]


def from_env() -> Ranks:
    """The ranks of a group this process already joined, else torchrun's environment, else one process."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        return Ranks(dist.get_rank(), world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    env = os.environ
    return Ranks(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", "1")))


@contextlib.contextmanager
def group(timeout_s: float) -> Iterator[Ranks]:
    """Join the process group torchrun's environment describes (if not joined yet) for the block.

    On the way out the group is destroyed (if this call made it), also when the block raises: a
    failing rank's sockets close, so the other ranks fail at their next collective rather than wait.
    """
    ranks = from_env()
    owns = ranks.parallel and not dist.is_initialized()
    if owns:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # a rendezvous that fails or times out: one line, not a traceback
            raise PeerFailed(f"rank {ranks.rank} of {ranks.world_size}: cannot join the others: {one_line(e)}") from e
        _joined.set()
    try:
        yield ranks
    except RuntimeError as e:
        if ranks.parallel and _from_collective(e):  # e.g. inside ZeRO's step: the same line as ours
            with _collective(ranks):
                raise
        raise
    finally:
        if owns and not _broken.is_set():
            dist.destroy_process_group()


_joined = threading.Event()  # this process joined a process group
_broken = threading.Event()  # a collective failed: a peer died or left, and this process's group is not torn down


def joined_a_group() -> bool:
    """Whether this process joined a process group: it ends without the interpreter's teardown (`cli.run`).
    torch's distributed objects destroyed at exit (a peer gone, or going) can abort the process
    (std::terminate: exit -6 after the run had finished, 1 run in 4 with a killed peer, rarer without)."""
    return _joined.is_set()


def is_main() -> bool:
    """Whether this process is rank 0 (or the only one)."""
    return from_env().is_main


@contextlib.contextmanager
def _collective(ranks: Ranks) -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise RuntimeError (DistError derives from it)
        _broken.set()
        raise PeerFailed(f"rank {ranks.rank} of {ranks.world_size}: another process of the run failed, left "
                         f"or did not answer (see its error): {one_line(e, 200)}") from e


def _from_collective(e: RuntimeError) -> bool:
    text = str(e)
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "NCCL", "Connection reset",
                                                                     "Connection closed", "Timed out"))


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Grads grouped by dtype and device into lists of about BUCKET_BYTES each, in order."""
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    for g in grads:
        key = (g.dtype, g.device)
        bucket, size = open_.get(key, ([], 0))
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        open_[key] = (bucket, size)
    for bucket, _ in open_.values():
        if bucket:
            yield bucket
