"""The bubble of a torch.distributed.pipelining schedule: its own action lists replayed with
measured per-stage times, beside the bubble measured per rank.

An action is (stage, kind, m): kind F (forward), B (full backward), I (input gradient) or W
(weight gradient) of micro-batch m on pipeline stage `stage` (of S x V stages; a rank holds V),
or one of torch's transfers SEND_F / RECV_F / SEND_B / RECV_B (COMMS). The multi-stage
schedules carry their lists (`schedule.pipeline_order`, rank -> actions, None for an idle
slot; DualPipeV's OVERLAP_F_B pairs run their two sub-actions one after the other here, as
they do on a CPU). GPipe's list is torch's; 1F1B's is scalelab's own 1F1B
(layout/schedule.py: the same order torch's Schedule1F1B executes), because
torch 2.13's `Schedule1F1B.pipeline_order` shifts the last rank's forwards by one micro-batch
(it lists 1F4 for 4 micro-batches: a list drawn for visualisation, not the one it runs).

`torch_order` draws a schedule's lists before anything runs (predict): torch's schedule class
built over placeholder stages (the numbers its order is computed from: stage index, stage
count, group size and rank; no module, process group or tensor), so a prediction replays the
order torch will execute, not a re-derivation of it. `comms=True` draws the multi-stage
schedules' lowered lists (`pipeline_order_with_comms`: torch's `_add_send_recv` places every
transfer), the lists `_PipelineScheduleRuntime._step_microbatches` walks.

Replay, two runtimes:
- the single-stage schedules (GPipe, 1F1B: PipelineScheduleSingle) fuse each step's send
  and recv into one waited batch: each rank runs its compute list in order; F(s, m) waits for
  F(s-1, m), B or I (s, m) for the backward of (s+1, m) and for F(s, m); W(s, m) for I(s, m);
  a dependency held by another rank arrives `send` seconds after it finished.
- the multi-stage schedules (_PipelineScheduleRuntime) post every SEND and RECV of the
  lowered list as its own `_batch_p2p`, unwaited, and wait a recv only in the compute that
  consumes it. NCCL runs a pair of ranks' point-to-point ops on one stream, in issue order,
  and an op completes only when the peer's matching op runs (rendezvous). So a transfer
  starts once the op issued before it on the pair has completed and the compute issued before
  it has finished (the NCCL stream waits for the compute stream at issue), and completes
  `send` seconds after both ends started; a compute waits for its recv.
  `device_sync` replays a run whose compute actions were each timed between two
  `torch.cuda.synchronize()`, as scalelab's torch engine once did (it
  times them with CUDA events now): a device-wide sync also waits for every transfer
  posted before it, NCCL's included, so there a compute waits for all of them. torch's
  lowering posts a rank's recv when the SENDER's compute is lowered, often well before the
  rank needs it, and a send completes only when the peer reaches its recv: each compute then
  waits for the peer's progress, the ranks move in lock-step.
Why (VGG-16, 2x H200, 8 micro-batches of 32, interleaved 1F1B over V = 2, a
record's own per-action times): the ranks compute 76 and 74 ms of a 156 ms step. The
dependency replay (the first rule) gives 78 ms, bubble 0.045; the runtime rule without the
sync 78 ms too (the FIFO alone costs nothing while transfers are free); with the sync 128 ms
with free transfers, 157 ms at 0.6 ms per transfer. Transfers at ~400 GB/s over that run's
cuts (205, 51 and 26 MB per micro-batch) and 0.2 ms of host work per action put each of the
64 actions where the record's timeline has it, within 0.33 ms rms (one clock offset per rank).
Timed with CUDA events instead (the same configuration on another 2x H200) the
step took 79.95 ms against 156.92 ms with the sync, in the same call.
A rank's bubble is 1 - (its seconds of compute) / (the makespan).

The schedule tables (torch's classes by name, which hold one, V or two stages per rank, which
cannot run eval) live here too, beside the replay, so predict/ reads them without importing a
strategy; strategies/pipeline/torch_stages.py builds the stages over them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from scalelab.errors import UsageError
from scalelab.layout.schedule import one_f_one_b_ops

# torch's schedule class for each name, by class name: torch.distributed.pipelining costs a
# second to import (it pulls in torch.export and dynamo), which every scalelab process would
# pay at start-up through this table; `schedule_class` imports it when a schedule is built.
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def schedule_class(name: str) -> type:
    """torch.distributed.pipelining's class for schedule `name` (a key of SCHEDULES)."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULES[name])


SINGLE = ("gpipe", "1f1b")  # one stage per rank (PipelineScheduleSingle)
V_SHAPE = ("zbv", "dualpipev")  # exactly two stages per rank, in a V
# torch 2.13: eval() of these runs their backward actions ("can't steal_bwd_input if this
# stage doesn't have backward" at 2I0 for ZBV), so their forward-only passes run the training
# schedule with a zero loss (a backward of zeros, the gradients dropped).
NO_EVAL = ("zero-bubble", "zbv", "dualpipev")
SPLIT_BACKWARD = NO_EVAL  # the schedules that run backward as input, then weight gradients


def virtual_stages(schedule: str, requested: int) -> int:
    if schedule in V_SHAPE:
        if requested not in (1, 2):
            raise UsageError(
                f"--schedule {schedule} holds 2 stages per rank; drop --virtual-stages"
            )
        return 2
    if schedule in SINGLE and requested != 1:
        raise UsageError(f"--schedule {schedule} holds one stage per rank; drop --virtual-stages")
    return requested


def stage_ids(schedule: str, rank: int, ranks: int, v: int) -> list[int]:
    """The pipeline stages (0 .. S*V - 1) rank `rank` of `ranks` holds."""
    if schedule in V_SHAPE:
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(v)]


Action = tuple[int, str, int]  # (stage, kind, micro-batch)
COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def _flatten(action: Any, kinds: tuple[str, ...] = COMPUTE) -> list[Action]:
    if action is None:
        return []
    if action.sub_actions:
        return [a for sub in action.sub_actions for a in _flatten(sub, kinds)]
    kind = action.computation_type.value
    if kind not in kinds:
        return []
    return [(action.stage_index, kind, action.microbatch_index)]


def schedule_actions(
    schedule: Any, name: str, ranks: int, micro: int, comms: bool = False
) -> dict[int, list[Action]]:
    """Every rank's compute actions in the order the schedule runs them; comms: with the
    transfers of a multi-stage schedule's lowered list where they run (single-stage
    schedules have none: their sends and recvs are fused into each step)."""
    if name == "1f1b":
        return {r: [(r, k, m) for k, m in one_f_one_b_ops(r, ranks, micro, True)]
                for r in range(ranks)}  # fmt: skip
    order, kinds = schedule.pipeline_order, COMPUTE
    if comms and name not in SINGLE:
        order, kinds = schedule.pipeline_order_with_comms, COMPUTE + COMMS
    return {r: [a for act in order[r] for a in _flatten(act, kinds)] for r in range(ranks)}


def torch_order(
    name: str, ranks: int, v: int, micro: int, comms: bool = False
) -> dict[int, list[Action]]:
    """Every rank's compute actions for torch's schedule `name` over `ranks` ranks holding
    `v` stages each (torch_stages.stage_ids places them), `micro` micro-batches (comms: and
    the transfers torch's lowering places, see schedule_actions). Every rank computes the
    whole order (torch: "all ranks do this calculation"): rank 0's stages do."""
    from types import SimpleNamespace

    from torch import nn

    n = ranks * v
    stubs = [
        SimpleNamespace(num_stages=n, group_size=ranks, group_rank=0, stage_index=i,
                        is_first=i == 0, is_last=i == n - 1, submod=nn.Module(),
                        stage_index_to_group_rank=None)
        for i in stage_ids(name, 0, ranks, v)
    ]  # fmt: skip
    schedule = schedule_class(name)(stubs[0] if name in SINGLE else stubs, n_microbatches=micro,
                               loss_fn=lambda out, target: out, scale_grads=False)  # fmt: skip
    return schedule_actions(schedule, name, ranks, micro, comms)


def _deps(action: Action, n_stages: int) -> list[Action]:
    s, kind, m = action
    if kind == "F":
        return [(s - 1, "F", m)] if s > 0 else []
    if kind == "W":
        return [(s, "I", m)]
    up = [(s, "F", m)]
    return up if s == n_stages - 1 else [*up, (s + 1, "B", m), (s + 1, "I", m)]


def replay(
    actions: Mapping[int, Sequence[Action]],
    seconds: Mapping[tuple[int, str], float],
    n_stages: int,
    send: float = 0.0,
    device_sync: bool = False,
    host: Mapping[tuple[int, str], float] | None = None,
) -> tuple[float, dict[int, float]]:
    """(makespan, busy seconds per rank); seconds[(stage, kind)]: one micro-batch's action
    on the device; send: the seconds one transfer takes between two ranks. Lists holding
    transfers (COMMS: torch's lowered lists) replay the multi-stage runtime, device_sync:
    each compute action also waits for every transfer its rank posted before it (scalelab's
    Clock on a GPU); compute-only lists replay the single-stage one (the module docstring
    says both). host[(stage, kind)]: the seconds the rank's Python spends issuing the action
    (HostLead: the host runs ahead of the device, an action ends no sooner than issued)."""
    lead = HostLead(host or {}, {r: 0.0 for r in actions})
    if any(a[1] in COMMS for acts in actions.values() for a in acts):
        return _replay_runtime(actions, seconds, send, device_sync, lead)
    return _replay_fused(actions, seconds, n_stages, send, lead)


class HostLead:
    """Each rank's host clock. The host issues a rank's actions in order, each taking
    host[(stage, kind)] seconds, without waiting for the device (a recv over NCCL waits on a
    stream, not on the host); an action's kernels cannot finish before their last launch, so
    it ends at max(device start + its device time, host clock after issuing it). A forward
    through torch's pipelining runtime at a small micro-batch is host-bound this way (the
    Python of every module call), its backward (autograd's C++ engine) is not."""

    def __init__(self, host: Mapping[tuple[int, str], float], clock: dict[int, float]):
        self.host, self.clock = host, clock

    def end(self, rank: int, act: Action, device_end: float) -> float:
        self.clock[rank] += self.host.get((act[0], act[1]), 0.0)
        return max(device_end, self.clock[rank])


def _replay_fused(
    actions: Mapping[int, Sequence[Action]],
    seconds: Mapping[tuple[int, str], float],
    n_stages: int,
    send: float,
    lead: HostLead,
) -> tuple[float, dict[int, float]]:
    holder = {a[0]: r for r, acts in actions.items() for a in acts}  # stage -> rank
    done: dict[tuple[int, str, int], float] = {}
    clock = {r: 0.0 for r in actions}
    pos = {r: 0 for r in actions}
    busy = {r: 0.0 for r in actions}
    present = {a for acts in actions.values() for a in acts}
    while any(pos[r] < len(actions[r]) for r in actions):
        progressed = False
        for r, acts in actions.items():
            while pos[r] < len(acts):
                act = acts[pos[r]]
                # A dependency that never runs (B vs I variants) is not waited for.
                needed = [d for d in _deps(act, n_stages) if d in present]
                if any(d not in done for d in needed):
                    break
                start = max([clock[r], *(done[d] + send * (holder[d[0]] != r) for d in needed)])
                t = seconds.get((act[0], act[1]), 0.0)
                clock[r] = done[act] = lead.end(r, act, start + t)
                busy[r] += t
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's action lists deadlock in the replay")
    return max(clock.values(), default=0.0), busy


# A transfer's matching op on the peer: SEND_F(s, m) -> RECV_F(s + 1, m), SEND_B(s, m) ->
# RECV_B(s - 1, m), and back.
_MATCH = {"SEND_F": ("RECV_F", 1), "RECV_F": ("SEND_F", -1),
          "SEND_B": ("RECV_B", -1), "RECV_B": ("SEND_B", 1)}  # fmt: skip


def _match(op: Action) -> Action:
    kind, step = _MATCH[op[1]]
    return (op[0] + step, kind, op[2])


def _runtime_preds(
    actions: Mapping[int, Sequence[Action]], device_sync: bool
) -> dict[Action, list[Action]]:
    """What each action waits for before it starts. A transfer: the op issued before it to
    the same peer (one NCCL stream per pair, in issue order) and the compute issued before it.
    A compute: the compute before it, and its own recv, or with device_sync every transfer
    posted since that compute (the earlier ones that compute already waited for)."""
    holder = {a[0]: r for r, acts in actions.items() for a in acts if a[1] in COMPUTE}
    recvs = {a for acts in actions.values() for a in acts if a[1].startswith("RECV")}
    preds: dict[Action, list[Action]] = {}
    for acts in actions.values():
        last_compute: Action | None = None
        last_on_pair: dict[int, Action] = {}
        posted: list[Action] = []
        for a in acts:
            if a[1] in COMPUTE:
                own = (a[0], "RECV_F" if a[1] == "F" else "RECV_B", a[2])
                waits = posted if device_sync else [own] if a[1] != "W" and own in recvs else []
                preds[a] = [x for x in (last_compute, *waits) if x is not None]
                last_compute, posted = a, []
                continue
            peer = holder[_match(a)[0]]
            preds[a] = [x for x in (last_on_pair.get(peer), last_compute) if x is not None]
            last_on_pair[peer] = a
            posted.append(a)
    return preds


def _replay_runtime(
    actions: Mapping[int, Sequence[Action]],
    seconds: Mapping[tuple[int, str], float],
    send: float,
    device_sync: bool,
    lead: HostLead,
) -> tuple[float, dict[int, float]]:
    preds = _runtime_preds(actions, device_sync)
    rank_of = {a: r for r, acts in actions.items() for a in acts}
    after: dict[Action, list[Action]] = {a: [] for a in preds}  # who waits for a
    for a, ps in preds.items():
        for p in ps:
            after[p].append(a)
    waiting = {a: len(ps) for a, ps in preds.items()}
    ready: dict[Action, float] = {}  # a transfer: when its own side could start
    end: dict[Action, float] = {}
    queue = [a for a, n in waiting.items() if n == 0]
    while queue:
        a = queue.pop()
        start = max((end[p] for p in preds[a]), default=0.0)
        if a[1] in COMPUTE:
            done = [a]
            end[a] = lead.end(rank_of[a], a, start + seconds.get((a[0], a[1]), 0.0))
        else:
            ready[a], peer = start, _match(a)
            if peer not in ready:
                continue
            # rendezvous: both ends done `send` after the later one started
            end[a] = end[peer] = max(start, ready[peer]) + send
            done = [a, peer]
        for d in done:
            for nxt in after[d]:
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    queue.append(nxt)
    if len(end) < len(preds):
        raise RuntimeError("the schedule's action lists deadlock in the replay")
    busy = {r: sum(seconds.get((a[0], a[1]), 0.0) for a in acts if a[1] in COMPUTE)
            for r, acts in actions.items()}  # fmt: skip
    return max(end.values(), default=0.0), busy


def simulated_bubble(
    actions: Mapping[int, Sequence[Action]],
    seconds: Mapping[tuple[int, str], float],
    n: int,
    device_sync: bool = False,
) -> dict[int, float]:
    makespan, busy = replay(actions, seconds, n, device_sync=device_sync)
    return {r: (1 - b / makespan if makespan > 0 else 0.0) for r, b in busy.items()}


def stage_seconds(rows: Sequence[dict], micro: int) -> dict[tuple[int, str], float]:
    """Per (stage, kind): one micro-batch's median seconds, from every rank's summary row."""
    out: dict[tuple[int, str], float] = {}
    for row in rows:
        for key, seconds in row["action_s"].items():
            stage, kind = key.split(":")
            out[(int(stage), kind)] = seconds / micro
    return out
