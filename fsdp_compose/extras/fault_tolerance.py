"""Fault-tolerant HSDP with torchft: replica groups that shard with ``fully_shard``, averaged by torchft.

``FaultTolerance(model, optimizer, pg=...)`` wires one replica group's rank to torchft 0.2.0 as torchtitan does
with torch's FSDP2: a ``torchft.Manager``, an all-reduce hook on every group of ``model`` (``manager.allreduce``:
the mean over the replica groups in the quorum), an optimizer that steps only when the quorum commits, and the
state-dict functions a recovering replica group loads. The same error on every rank of a group for what is ours
to check: torchft's configuration, the hook not covering the optimizer's parameters or ``model`` not the root,
and at each new quorum replica groups holding other parameter names, shapes or dtypes (at step 0, other weights).
The state dict reads only the sharded ``DTensor``s (collected once) and the optimizer's state, which nothing
writes outside an optimizer step, under a lock that each step and load also hold: safe from any thread. torchft
is imported when a ``FaultTolerance`` is built, so this module imports without it. See docs/fault-tolerance.md.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp
from torch.distributed.tensor import DTensor

from ..extras_api import group_facts, group_of, groups_in, owner_of, raise_together

FINGERPRINT = 1 << 20  # fingerprints below 2**20: their squares summed over 4096 groups stay exact in float64


class FaultToleranceError(RuntimeError):
    """torchft misconfigured, the hook not covering the model, or replica groups holding different models."""

    __module__ = "fsdp_compose"  # its public home: tracebacks print fsdp_compose.<name>, pickle finds it there


def _torchft() -> Any:
    """torchft, the optional 'ft' extra: imported when a ``FaultTolerance`` is built, so this module (and the
    names ``fsdp_compose`` exports from it) imports without it."""
    try:
        import torchft
    except ImportError as missing:
        raise ImportError(
            "FaultTolerance needs torchft 0.2.0 (the 'ft' extra): pip install torch==2.13.0 -e '.[ft]', or "
            "pip install --no-deps torchft==0.2.0 opentelemetry-sdk opentelemetry-exporter-otlp-proto-http "
            f"({missing})"
        ) from missing
    return torchft


def _fingerprint(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") % FINGERPRINT


def _lighthouse_problem(address: str | None, timeout_s: float) -> str | None:
    """Why rank 0 could not reach the lighthouse at ``address``, or None."""
    if not address:
        return "no torchft lighthouse address: pass lighthouse='http://host:port' or set TORCHFT_LIGHTHOUSE"
    url = urlparse(address)
    if url.scheme not in ("http", "https") or not url.hostname or url.port is None:
        return f"the lighthouse address {address!r} is not of the form http://host:port"
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout_s).close()
    except OSError as error:
        return f"the torchft lighthouse at {address} does not answer ({error}); start it with torchft_lighthouse"
    return None


class FaultTolerantOptimizer(torch.optim.Optimizer):
    """What torchft's ``OptimizerWrapper`` does: ``zero_grad()`` starts the step's quorum, ``step()`` steps the
    wrapped optimizer (``optim``) only if the quorum commits (``committed`` says whether it did); the step holds
    the state-dict lock. ``state_dict``, ``param_groups`` and ``state`` are the wrapped optimizer's."""

    def __init__(self, owner: FaultTolerance, manager: Any, optimizer: torch.optim.Optimizer) -> None:
        # not Optimizer.__init__: no parameters of its own, as torchft's wrapper
        self.optim, self.manager, self._owner = optimizer, manager, owner
        self.committed: bool | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def step(self, closure: object | None = None) -> None:
        if closure is not None:
            raise FaultToleranceError("FaultTolerantOptimizer.step: closures are not supported (torchft's wrapper)")
        self._owner._check_root()
        self.committed = self.manager.should_commit()
        if self.committed:
            with self._owner._lock:
                self.optim.step()


class FaultTolerance:
    """One replica group's rank of fault-tolerant HSDP: ``model`` (the root ``fully_shard`` module) and
    ``optimizer`` wired to a ``torchft.Manager`` on ``pg`` (e.g. ``torchft.ProcessGroupGloo()``).

    ``group`` is this replica group's ranks (default: the job's, when each replica group is a torchrun job of its
    own). ``lighthouse`` (default: ``TORCHFT_LIGHTHOUSE``) and ``replica_id`` are read on the group's rank 0, as
    by the manager; other keywords go to ``torchft.Manager``. ``init_sync`` defaults to False: build the model from
    the same seed in every group, which the step-0 check verifies (torchft's True makes the first step average
    one group's gradient shards with zeros: its copies of them are being replaced instead). Train with
    ``self.optimizer``: ``zero_grad()`` before the forward, ``step()`` after the backward.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        pg: Any,
        group: dist.ProcessGroup | None = None,
        min_replica_size: int = 1,
        replica_id: str | None = None,
        lighthouse: str | None = None,
        init_sync: bool = False,
        **manager_options: Any,
    ) -> None:
        _torchft()  # the extra, or an ImportError saying how to install it, on every rank before any collective
        if not dist.is_initialized():
            raise FaultToleranceError(
                "FaultTolerance: init_process_group first (each replica group is a torchrun job of its own, "
                "whose process group its fully_shard uses and whose store the torchft manager joins)"
            )
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        # our checks' own group (one object collective each): never among the model's collectives
        self._agreement = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self._rank, self._world = dist.get_rank(group), dist.get_world_size(group)
        self.model, self._lock = model, threading.RLock()
        self._params = self._sharded_parameters(model, optimizer)
        self._buffers = [(name, b) for name, b in model.named_buffers()]
        self._shapes = _fingerprint(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in self._params]).encode())
        self._numel = sum(p.numel() for _, p in self._params)
        self._root_checked = False
        self._quorums = self._checked = 0  # reconfigurations of ``pg``; the last one checked
        self._pg = self._observed(pg)
        lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        self.manager = self._build_manager(
            pg, lighthouse, replica_id, min_replica_size, init_sync=init_sync, **manager_options
        )
        self.optimizer = FaultTolerantOptimizer(self, self.manager, optimizer)
        self.all_reduce_hook: Callable[[torch.Tensor], None] = self._all_reduce
        for module in {group_facts(handle).modules[0] for _, handle in groups_in(model)}:
            module.set_all_reduce_hook(self.all_reduce_hook)

    # ----- construction checks ---------------------------------------------------------------------
    def _sharded_parameters(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, DTensor]]:
        """``model``'s sharded parameters by name; every parameter the optimizer steps must be one of them."""
        handle = group_of(model)
        problem, passed = None, type(model).__name__
        if handle is None:
            problem = (
                f"FaultTolerance: the {passed} passed is not sharded; call fully_shard on its blocks, then on it "
                "(the root), and pass the root"
            )
        else:
            passed = group_facts(handle).label
        ours = {id(p.parameter) for _, h in groups_in(model) for p in group_facts(h).params}
        names = {id(p): name for name, p in model.named_parameters()}
        for group in optimizer.param_groups if problem is None else []:
            for param in group["params"]:
                if id(param) in ours:
                    continue
                owner = owner_of(param)
                where = "a parameter fully_shard does not manage"
                if owner is not None:
                    facts = group_facts(owner)
                    fqn = next((p.fqn for p in facts.params if p.parameter is param), "?")
                    where = f"'{fqn}' of group {facts.label}"
                problem = (
                    f"FaultTolerance: the optimizer steps {where} (shape {tuple(param.shape)}), which is outside the "
                    f"groups of the module passed, {passed}: its gradient would never be averaged across replica "
                    "groups. Pass the root module (the one fully_shard was called on last)"
                )
                break
            if problem:
                break
        raise_together(problem, group=self._agreement, cls=FaultToleranceError)
        params = [p for _, h in groups_in(model) for p in group_facts(h).params]
        return [(names.get(id(p.parameter), p.fqn), p.parameter) for p in params]

    def _build_manager(
        self, pg: Any, lighthouse: str | None, replica_id: str | None, min_replica_size: int, **options: Any
    ) -> Any:
        """Rank 0 first (it starts the manager server the other ranks look up): a failure there is every rank's."""
        torchft = _torchft()
        problem = None
        if not isinstance(pg, torchft.process_group.ProcessGroup):
            problem = f"pg must be a torchft process group (e.g. torchft.ProcessGroupGloo()), got {type(pg).__name__}"
        elif isinstance(min_replica_size, bool) or not isinstance(min_replica_size, int) or min_replica_size < 1:
            problem = f"min_replica_size must be a positive int, got {min_replica_size!r}"
        elif "store_addr" not in options and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
            problem = "the torchft manager joins the job's store: set MASTER_ADDR and MASTER_PORT (torchrun does)"
        elif self._rank == 0:
            connect = options.get("connect_timeout")
            problem = _lighthouse_problem(lighthouse, 10.0 if connect is None else connect.total_seconds())
        raise_together(problem and f"FaultTolerance: {problem}", group=self._agreement, cls=FaultToleranceError)

        def build() -> Any:
            return torchft.Manager(
                pg=pg,
                load_state_dict=self.load_state_dict,
                state_dict=self.state_dict,
                min_replica_size=min_replica_size,
                rank=self._rank,
                world_size=self._world,
                lighthouse_addr=lighthouse,
                replica_id=replica_id,
                **options,
            )

        manager, failure = None, None
        if self._rank == 0:
            try:
                manager = build()
            except Exception as error:  # noqa: BLE001 - every rank raises it below
                failure = f"FaultTolerance: torchft.Manager failed on rank 0: {type(error).__name__}: {error}"
        raise_together(failure, group=self._agreement, cls=FaultToleranceError, source=0)
        return manager if manager is not None else build()

    def _check_root(self) -> None:
        """At the first step (the root is known after the first forward): ``model`` must be the root, and its
        sharded parameters those collected at construction."""
        if self._root_checked:
            return
        self._root_checked = True
        facts = group_facts(group_of(self.model))
        if facts.root is not None and facts.root is not facts.handle:
            raise FaultToleranceError(
                f"FaultTolerance: the module passed, {facts.label}, is not the root of its sharded model, "
                f"{group_facts(facts.root).label} is: pass the root, so the hook covers every group"
            )
        now = {id(p.parameter) for _, h in groups_in(self.model) for p in group_facts(h).params}
        if now != {id(param) for _, param in self._params}:
            raise FaultToleranceError(
                "FaultTolerance: the model's sharded parameters were replaced after FaultTolerance was built "
                "(model.to(...), load_state_dict(assign=True)): build it, like the optimizer, after those"
            )

    # ----- the all-reduce across replica groups -----------------------------------------------------
    def _observed(self, pg: Any) -> Any:
        """Count ``pg``'s reconfigurations: torchft calls ``configure`` once per new quorum, on every member."""
        configure = getattr(pg, "configure", None)
        if callable(configure):

            def observed(*args: Any, **kwargs: Any) -> None:
                try:
                    configure(*args, **kwargs)
                finally:  # a failed one too: every rank of the group checks at the same step
                    self._quorums += 1

            pg.configure = observed
        return pg

    def _all_reduce(self, output: torch.Tensor) -> None:
        """The hook: average ``output`` (a group's reduced gradient shard, summed over this group's ranks) over
        the replica groups in the quorum. A failure is recorded by the manager, which then refuses the commit."""
        self.manager.wait_quorum()
        if self._checked != self._quorums:
            self._check_replicas(output.device)
        self.manager.allreduce(output).wait()

    def _check_replicas(self, device: torch.device) -> None:
        """At the first all-reduce after a new quorum: do the replica groups hold the same model?

        Every member of the quorum's process group (this rank's peers in the other groups) sums
        ``[p, p*s, p*s^2, p*w, p*w^2]``: ``p`` 1 for a group training this step (0 for one recovering, whose
        weights are about to be replaced), ``s`` the fingerprint of every parameter's name, shape and dtype, ``w``
        that of this rank's shards at step 0. The training groups agree iff ``n * sum(s^2) == sum(s)^2``."""
        self._checked = self._quorums
        training = self.manager.is_participating()
        p = 1.0 if training else 0.0
        w = self._weights_fingerprint() if training and self.manager.current_step() == 0 else 0
        s = self._shapes
        sums = torch.tensor([p, p * s, p * s * s, p * w, p * w * w], dtype=torch.float64, device=device)
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        problem = None
        try:
            self._pg.allreduce([sums], options).wait()
        except Exception as error:  # noqa: BLE001 - a peer lost: torchft refuses this step's commit
            self.manager.report_error(error)
        else:
            problem = self._verdict([int(v) for v in sums.tolist()], training)
        raise_together(problem, group=self._agreement, cls=FaultToleranceError)

    def _verdict(self, sums: list[int], training: bool) -> str | None:
        n, s1, s2, w1, w2 = sums
        here = f"here {len(self._params)} parameters, {self._numel:,} elements, shape fingerprint {self._shapes:05x}"
        if n == 0:
            return None
        if n * s2 != s1 * s1:
            return (
                f"the {n} replica groups training in this quorum hold different models (parameter names, shapes or "
                f"dtypes differ; {here}): every replica group must build the same model"
            )
        if not training and self._shapes * n != s1:
            return (
                f"this replica group's model differs from the {n} replica group(s) it joins (parameter names, "
                f"shapes or dtypes; {here}, theirs {s1 // n:05x}): it must build the same model to recover from them"
            )
        if n * w2 != w1 * w1:
            return (
                f"the {n} replica groups start from different weights (a rank's shards differ at step 0): build the "
                "model from the same seed in every replica group, or pass init_sync=True (torchft then copies one "
                "group's weights at step 0)"
            )
        return None

    def _weights_fingerprint(self) -> int:
        digest = hashlib.blake2b(digest_size=8)
        for _, param in self._params:
            local = param.to_local().detach()
            digest.update(local.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return int.from_bytes(digest.digest(), "little") % FINGERPRINT

    # ----- the state torchft sends to a recovering replica group --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shards, buffers and optimizer state as plain tensors (views of the live ones, like
        ``state_dict()``'s). Safe from any thread: it reads only the sharded parameters and the optimizer's
        state, which nothing writes outside an optimizer step or a load, and both hold the same lock."""
        with self._lock:
            optim = self.optimizer.optim.state_dict()
            optim["state"] = {index: dict(state) for index, state in optim["state"].items()}  # not the live dicts
            sharded = []
            for index, state in optim["state"].items():
                for key, value in state.items():
                    if isinstance(value, DTensor):
                        state[key] = value.to_local()
                        sharded.append((index, key))
            return {
                "model": {name: param.to_local().detach() for name, param in self._params},
                "buffers": dict(self._buffers),
                "optimizer": optim,
                "sharded_optimizer_state": sharded,
            }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict()`` of the same rank of another replica group returned (torchft calls it in a
        recovering group, from ``should_commit``). Names, shapes and dtypes are checked first."""
        with self._lock:
            values = state["model"]
            locals_ = [(name, param.to_local()) for name, param in self._params]
            for name, local in locals_:
                value = values.get(name)
                if value is None or value.shape != local.shape or value.dtype != local.dtype:
                    found = "missing" if value is None else f"{tuple(value.shape)} {value.dtype}"
                    raise FaultToleranceError(
                        f"FaultTolerance.load_state_dict: '{name}' is {tuple(local.shape)} {local.dtype} on this "
                        f"rank, {found} in the state received: the replica groups must build the same model"
                    )
            for name, local in locals_:
                local.copy_(values[name])
            for name, buffer in self._buffers:
                if name in state["buffers"]:
                    buffer.copy_(state["buffers"][name])
            optim = state["optimizer"]
            params = [p for group in self.optimizer.optim.param_groups for p in group["params"]]
            for index, key in state["sharded_optimizer_state"]:
                param, local = params[index], optim["state"][index][key]
                optim["state"][index][key] = DTensor.from_local(
                    local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                    stride=param.stride(),
                )
            self.optimizer.optim.load_state_dict(optim)

    def shutdown(self) -> None:
        """Stop the manager's server and checkpoint transport and close ``pg`` (at the end of training, or after
        an error: the other replica groups then see this one leave at once, not at their timeout)."""
        self.manager.shutdown(wait=False)
        self._pg.abort()
