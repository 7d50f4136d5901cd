"""The pipeline schedule IR: per-device ordered compute actions, a placement and a partition.

Text form follows torch.distributed.pipelining: an action is ``"<stage><type><microbatch>"``
(``"2F0"`` forward of microbatch 0 on stage 2, ``"1I3"`` backward-input, ``"1W3"`` backward-weight,
``"0B1"`` fused backward), and a schedule's CSV has one row per rank with that rank's actions in
order, which ``_PipelineScheduleRuntime._load_csv`` reads (it infers the stage-to-rank map).

Contract: a ``Schedule`` is immutable; ``validate()`` checks that every (stage, microbatch) has
exactly one F and either one B or one I and one W, each on the device that holds the stage. It does
not check for deadlock: the simulator does (a cyclic order cannot be simulated).
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from steptune.core.textfile import NotTextError, read_text

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleError"]


class ScheduleError(ValueError):
    """A schedule that is malformed, inconsistent with its placement, or cannot run."""


class ActionKind(StrEnum):
    F = "F"  # forward
    I = "I"  # noqa: E741  backward, input gradient
    W = "W"  # backward, weight gradient
    B = "B"  # fused backward (I then W)


_ACTION_RE = re.compile(r"^(\d+)([FIWB])(\d+)$")
# torch's CSV may also hold actions that are not compute: FSDP/DDP's (UNSHARD, RESHARD, REDUCE_GRAD) and, in
# its full format, the communication (SEND_F, RECV_F, SEND_B, RECV_B); the executor adds its own.
_NOT_COMPUTE_RE = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)\d*$")
# DualPipeV's overlapped forward and backward: "(0F7;7B3)OVERLAP_F_B", run as its parts in order.
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ScheduleError(f"bad action {text!r}: write <stage><F|I|W|B><microbatch>, e.g. 2F0")
        return Action(int(m.group(1)), ActionKind(m.group(2)), int(m.group(3)))


@dataclass(frozen=True, kw_only=True)
class Schedule:
    name: str
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    """Device of each stage."""
    orders: tuple[tuple[Action, ...], ...]
    """Per device, its actions in execution order."""
    partition: tuple[int, ...] | None = None
    """Layers (units of the model's layer list) per stage, in stage order; None when not tied to a model."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_devices(self) -> int:
        return len(self.orders)

    def stages_of(self, device: int) -> list[int]:
        return [s for s, d in enumerate(self.placement) if d == device]

    def validate(self) -> Schedule:
        if self.num_stages < 1 or self.num_microbatches < 1:
            raise ScheduleError(
                f"need >= 1 stage and >= 1 microbatch, got {self.num_stages} and {self.num_microbatches}"
            )
        if len(self.placement) != self.num_stages:
            raise ScheduleError(f"placement has {len(self.placement)} entries for {self.num_stages} stages")
        if any(not 0 <= d < self.num_devices for d in self.placement):
            raise ScheduleError(
                f"placement {self.placement} names a device outside 0..{self.num_devices - 1}"
            )
        if self.partition is not None and (
            len(self.partition) != self.num_stages or any(n < 1 for n in self.partition)
        ):
            raise ScheduleError(
                f"partition {self.partition} must give >= 1 layer to each of {self.num_stages} stages"
            )
        seen: dict[tuple[int, ActionKind, int], int] = {}
        for device, order in enumerate(self.orders):
            for a in order:
                if not (0 <= a.stage < self.num_stages and 0 <= a.microbatch < self.num_microbatches):
                    raise ScheduleError(
                        f"action {a} on device {device} is out of range "
                        f"({self.num_stages} stages, {self.num_microbatches} microbatches)"
                    )
                if self.placement[a.stage] != device:
                    raise ScheduleError(
                        f"action {a} is on device {device} but stage {a.stage} is placed on "
                        f"device {self.placement[a.stage]}"
                    )
                key = (a.stage, a.kind, a.microbatch)
                if key in seen:
                    raise ScheduleError(f"action {a} appears twice")
                seen[key] = device
        for s in range(self.num_stages):
            for m in range(self.num_microbatches):
                has = {k for k in ActionKind if (s, k, m) in seen}
                if ActionKind.F not in has:
                    raise ScheduleError(f"missing forward {s}F{m}")
                if has - {ActionKind.F} not in ({ActionKind.B}, {ActionKind.I, ActionKind.W}):
                    raise ScheduleError(
                        f"stage {s} microbatch {m} needs exactly one backward: either {s}B{m} "
                        f"or both {s}I{m} and {s}W{m}; found {sorted(k.value for k in has)}"
                    )
        return self

    # --- text forms -------------------------------------------------------------------------

    def to_csv(self) -> str:
        """torch's compute-only CSV: one row per rank, its actions in order."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for order in self.orders:
            writer.writerow([str(a) for a in order])
        return buf.getvalue()

    @staticmethod
    def from_csv(text: str, *, num_microbatches: int | None = None, name: str = "csv") -> Schedule:
        """Parse torch's CSV (``_dump_csv``: one row per rank): compute actions are kept, an overlapped
        ``(F;B)OVERLAP_F_B`` becomes its parts in order, and FSDP/DDP and communication actions are skipped
        (counted in ``meta["skipped_actions"]``). The placement is inferred from where each stage's
        actions are."""
        rows = list(csv.reader(io.StringIO(text)))
        while rows and not any(cell.strip() for cell in rows[-1]):
            rows.pop()  # trailing blank lines are not ranks
        orders, skipped = [], 0
        for row in rows:
            order: list[Action] = []
            for cell in (c.strip() for c in row):
                if not cell:
                    continue
                if _NOT_COMPUTE_RE.match(cell):
                    skipped += 1
                elif m := _OVERLAP_RE.match(cell):
                    order += [Action.parse(part) for part in m.group(1).split(";")]
                else:
                    order.append(Action.parse(cell))
            orders.append(tuple(order))
        placement: dict[int, int] = {}
        for device, order in enumerate(orders):
            for a in order:
                if placement.setdefault(a.stage, device) != device:
                    raise ScheduleError(
                        f"stage {a.stage} has actions on devices {placement[a.stage]} and {device}"
                    )
        if not placement:
            raise ScheduleError("empty schedule")
        num_stages = max(placement) + 1
        if sorted(placement) != list(range(num_stages)):
            raise ScheduleError(f"stages {sorted(set(range(num_stages)) - set(placement))} have no actions")
        mbs = 1 + max(a.microbatch for order in orders for a in order)
        sched = Schedule(
            name=name,
            num_stages=num_stages,
            num_microbatches=num_microbatches or mbs,
            placement=tuple(placement[s] for s in range(num_stages)),
            orders=tuple(orders),
            meta={"skipped_actions": skipped} if skipped else {},
        )
        return sched.validate()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "placement": list(self.placement),
            "partition": list(self.partition) if self.partition else None,
            "orders": [[str(a) for a in order] for order in self.orders],
            "meta": self.meta,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Schedule:
        if not isinstance(data, dict):
            raise ScheduleError(f"schedule JSON must be an object, got a {type(data).__name__}")
        for key in ("num_stages", "num_microbatches"):
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ScheduleError(f"schedule JSON field {key} must be a whole number, got {value!r}")
        missing = [
            k for k in ("name", "num_stages", "num_microbatches", "placement", "orders") if k not in data
        ]
        if missing:
            raise ScheduleError(f"schedule JSON is missing {', '.join(missing)}")

        def whole_numbers(key: str, value: Any) -> tuple[int, ...]:
            ok = isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            )
            if not ok:
                raise ScheduleError(
                    f"schedule JSON field {key} must be a list of whole numbers, got {value!r}"
                )
            return tuple(value)

        orders = data["orders"]
        if not isinstance(orders, list) or not all(
            isinstance(o, list) and all(isinstance(a, str) for a in o) for o in orders
        ):
            raise ScheduleError(
                "schedule JSON field orders must be a list per device of action strings, "
                'e.g. [["0F0", "0B0"]]'
            )
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ScheduleError(f"schedule JSON field meta must be an object, got {meta!r}")
        split = meta.get("head_split", 1)
        if not isinstance(split, int) or isinstance(split, bool) or split < 1:
            raise ScheduleError(
                f"schedule JSON field meta.head_split must be a whole number >= 1, got {split!r}"
            )
        return Schedule(
            name=str(data["name"]),
            num_stages=data["num_stages"],
            num_microbatches=data["num_microbatches"],
            placement=whole_numbers("placement", data["placement"]),
            partition=whole_numbers("partition", data["partition"]) if data.get("partition") else None,
            orders=tuple(tuple(Action.parse(a) for a in order) for order in orders),
            meta=meta,
        ).validate()

    def save(self, path: str | Path) -> Path:
        """Write ``path`` as JSON (``.json``) or torch CSV (``.csv``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            self.to_csv() if path.suffix.lower() == ".csv" else json.dumps(self.to_json(), indent=1)
        )
        return path

    @staticmethod
    def load(path: str | Path) -> Schedule:
        path = Path(path)
        try:
            text = read_text(path, "schedule")
        except NotTextError as exc:
            raise ScheduleError(str(exc)) from None
        if path.suffix.lower() == ".csv":
            return Schedule.from_csv(text, name=path.stem)
        try:
            return Schedule.from_json(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ScheduleError(f"{path}: not JSON ({exc}); a .csv file is read as torch's CSV") from exc
