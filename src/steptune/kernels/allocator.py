"""Elastic allocation of K evaluation workers between validation and profiling (SpecGen's Elastic Scheduler).

Contract: pure and clock-free. Every call carries `now`, seconds on the caller's clock (the simulator's
virtual time or the event loop's `loop.time()`), and timestamps must not decrease. The allocator only
recommends a split: `decide` returns the new number of validation workers k_v and the caller re-roles its
pool, e.g. `pool.set_roles(allocator.roles(k_v))`. Roles change at job boundaries: the pool never preempts a
running job (a timing run above all), so a re-roled worker finishes what it holds first. Enforcing that is
the pool's and the caller's job, not this module's.

Model (an approximation, by design): each kind is a station whose offered load is λS, the number of busy
workers its work needs (λ arrivals per second, S mean service seconds). With k_v validation workers the
bottleneck utilization is max(λ_v S_v / k_v, λ_p S_p / (K - k_v)); `decide` picks the k_v in
[min_validate, K - min_profile] that minimizes it, preferring the current k_v on ties, then the nearest.
Queue backlogs are not modelled: a backlog shows up as arrivals before it shows up as load.
Estimates are exponentially weighted with time constant `window_s`. Rates are decayed arrival counts divided
by the decayed length of the observed span (from the first timestamp seen), so they are unbiased from the
start rather than only after a window has passed. A kind with no arrivals has rate 0; a kind with no service
samples borrows the other kind's mean service time, or 1 s when neither has one.
Stability: no change comes sooner than `min_interval_s` after the previous one (the first timestamp seen
counts as the initial one), and a change must cut the predicted bottleneck load by more than `hysteresis`,
not only at the point estimates but for every demand within `noise_z` standard errors of them. Hysteresis
alone does not stop flapping: with sparse profiling traffic (say 0.5 requests/s over a 60 s window) the
demand estimates wander by 15-20%, more than a 10% band. The price: with few arrivals per window the split
settles within the noise of the optimum, sometimes a worker short of it; lower `noise_z` or lengthen
`window_s` to trade stability for precision.
With one worker there is nothing to split: `roles` gives ["any"] and `decide` always returns None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["AllocatorConfig", "ElasticAllocator"]

Kind = Literal["validate", "profile"]
_KINDS: tuple[Kind, Kind] = ("validate", "profile")


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorConfig:
    """How quickly the allocator reacts and how much evidence it needs before it moves a worker."""

    window_s: float = 60.0
    """Time constant (seconds) of the exponentially weighted arrival rates and service times."""
    min_interval_s: float = 20.0
    """No two changes closer than this (seconds); the first change comes this long after the first event."""
    hysteresis: float = 0.10
    """Change only if the predicted bottleneck load improves by more than this fraction of the current one."""
    noise_z: float = 1.0
    """The improvement must also hold for every demand within this many standard errors of the estimates
    (Poisson arrival counts, weighted service-time spread), so sparse traffic cannot flap the split; 0 trusts
    the point estimates."""
    min_validate: int = 1
    """Fewest validation workers (with two or more workers)."""
    min_profile: int = 1
    """Fewest profiling workers (with two or more workers)."""


class _Decayed:
    """Weighted sums Σw, Σw·x, Σw·x², Σw² with w_i = exp(-(now - t_i) / tau), advanced lazily."""

    __slots__ = ("sums", "t", "tau")

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.t = -math.inf
        self.sums = (0.0, 0.0, 0.0, 0.0)

    def add(self, x: float, now: float) -> None:
        w, wx, wxx, ww = self.at(now)
        self.t = now
        self.sums = (w + 1.0, wx + x, wxx + x * x, ww + 1.0)

    def at(self, now: float) -> tuple[float, float, float, float]:
        if self.sums[0] == 0.0:
            return self.sums
        f = math.exp(-max(0.0, now - self.t) / self.tau)
        w, wx, wxx, ww = self.sums
        return w * f, wx * f, wxx * f, ww * f * f


class ElasticAllocator:
    """Splits `num_workers` evaluation workers into validation and profiling roles from observed traffic."""

    def __init__(
        self, num_workers: int, config: AllocatorConfig | None = None, initial_validate: int | None = None
    ) -> None:
        cfg = config or AllocatorConfig()
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: pass at least 1 evaluation worker")
        if not (cfg.window_s > 0 and math.isfinite(cfg.window_s)):
            raise ValueError(f"window_s={cfg.window_s}: pass a positive, finite time constant in seconds")
        if not cfg.min_interval_s >= 0:
            raise ValueError(f"min_interval_s={cfg.min_interval_s}: pass 0 or more seconds")
        if not 0 <= cfg.hysteresis < 1:
            raise ValueError(f"hysteresis={cfg.hysteresis}: pass a fraction in [0, 1), e.g. 0.1")
        if not (cfg.noise_z >= 0 and math.isfinite(cfg.noise_z)):
            raise ValueError(f"noise_z={cfg.noise_z}: pass 0 or more standard errors, e.g. 1")
        if cfg.min_validate < 0 or cfg.min_profile < 0:
            raise ValueError(
                f"min_validate={cfg.min_validate}, min_profile={cfg.min_profile}: pass 0 or more each"
            )
        if num_workers >= 2 and cfg.min_validate + cfg.min_profile > num_workers:
            raise ValueError(
                f"min_validate + min_profile = {cfg.min_validate + cfg.min_profile} exceeds "
                f"num_workers={num_workers}: lower the minimums or add workers"
            )
        self.num_workers = num_workers
        self.config = cfg
        self._lo = min(cfg.min_validate, num_workers)
        self._hi = max(self._lo, num_workers - cfg.min_profile)
        if initial_validate is None:
            initial_validate = min(self._hi, max(self._lo, (num_workers + 1) // 2))
        elif num_workers >= 2 and not self._lo <= initial_validate <= self._hi:
            raise ValueError(
                f"initial_validate={initial_validate}: pass a value in [{self._lo}, {self._hi}] "
                f"(num_workers={num_workers}, min_validate={cfg.min_validate}, min_profile={cfg.min_profile})"
            )
        self._k = initial_validate if num_workers >= 2 else 1
        self._arrivals = {kind: _Decayed(cfg.window_s) for kind in _KINDS}
        self._service = {kind: _Decayed(cfg.window_s) for kind in _KINDS}
        self._start: float | None = None
        self._now = -math.inf
        self._last_change = -math.inf
        self.history: list[tuple[float, int, str]] = []
        """(now, k_v, reason) for the initial split (at the first timestamp seen) and every change."""

    @property
    def num_validate(self) -> int:
        """The current number of validation workers k_v (1 with a single `any` worker)."""
        return self._k

    def roles(self, k_v: int | None = None) -> list[str]:
        """Worker roles for k_v validation workers (default: the current split); ["any"] with one worker."""
        if self.num_workers == 1:
            return ["any"]
        k = self._k if k_v is None else k_v
        if not 0 <= k <= self.num_workers:
            raise ValueError(f"k_v={k}: pass a count in [0, {self.num_workers}]")
        return ["validate"] * k + ["profile"] * (self.num_workers - k)

    def observe_arrival(self, kind: Kind, now: float) -> None:
        """Record that one `kind` request ("validate" or "profile") was queued at `now`."""
        self._clock(now)
        self._arrivals[_check_kind(kind)].add(1.0, now)

    def observe_service(self, kind: Kind, seconds: float, now: float) -> None:
        """Record that a `kind` request held a worker for `seconds` (reported when it finished, at `now`)."""
        self._clock(now)
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds={seconds}: pass the finite, non-negative time the job held a worker")
        self._service[_check_kind(kind)].add(seconds, now)

    def rate(self, kind: Kind, now: float) -> float:
        """Smoothed arrivals per second of `kind` (0 before any arrival or at the first timestamp)."""
        window = self._window(now)
        return self._arrivals[_check_kind(kind)].at(now)[0] / window if window > 0 else 0.0

    def service_time(self, kind: Kind, now: float) -> float:
        """Smoothed mean service seconds of `kind`; the other kind's before any sample, else 1 s."""
        w, wx, _, _ = self._service_sums(_check_kind(kind), now)
        return wx / w if w > 0 else 1.0

    def demand(self, now: float) -> tuple[float, float]:
        """Offered load (λS, busy workers' worth of work) of validation and of profiling."""
        return (
            self.rate("validate", now) * self.service_time("validate", now),
            self.rate("profile", now) * self.service_time("profile", now),
        )

    def demand_error(self, kind: Kind, now: float) -> float:
        """Standard error of `kind`'s demand, in workers: the Poisson error of the weighted arrival count (at
        least one arrival's worth, so a kind not seen yet is not taken to be certainly idle) combined with the
        standard error of the weighted mean service time."""
        window = self._window(now)
        if window <= 0:
            return math.inf
        w, wx, wxx, ww = self._service_sums(_check_kind(kind), now)
        mean = wx / w if w > 0 else 1.0
        spread = math.sqrt(max(0.0, wxx / w - mean**2)) if w > 0 else 0.0
        service_error = spread * math.sqrt(ww) / w if w > 0 else 0.0
        rate_error = math.sqrt(max(self._arrivals[kind].at(now)[3], 1.0)) / window
        return math.hypot(rate_error * mean, self.rate(kind, now) * service_error)

    def _window(self, now: float) -> float:
        """Σ of the decay weights over the observed span: the seconds a decayed count is spread over."""
        span = 0.0 if self._start is None else now - self._start
        return self.config.window_s * -math.expm1(-span / self.config.window_s) if span > 0 else 0.0

    def _service_sums(self, kind: Kind, now: float) -> tuple[float, float, float, float]:
        for k in (kind, _other(kind)):
            sums = self._service[k].at(now)
            if sums[0] > 0:
                return sums
        return (0.0, 0.0, 0.0, 0.0)

    def utilization(self, k_v: int, now: float) -> float:
        """Predicted bottleneck utilization with k_v validation workers (inf if a loaded kind has none)."""
        d_v, d_p = self.demand(now)
        return _bottleneck(k_v, self.num_workers, d_v, d_p)

    def decide(self, now: float) -> int | None:
        """The new number of validation workers, or None to keep the current split."""
        self._clock(now)
        if self.num_workers == 1 or now - self._last_change < self.config.min_interval_s:
            return None
        d_v, d_p = self.demand(now)
        if d_v == 0.0 and d_p == 0.0:
            return None
        load = {k: _bottleneck(k, self.num_workers, d_v, d_p) for k in range(self._lo, self._hi + 1)}
        errors = (self.demand_error("validate", now), self.demand_error("profile", now))
        # Best first; the current split is a candidate, so this either returns or breaks at a better split.
        for k in sorted(load, key=lambda k: (load[k], abs(k - self._k))):
            if k == self._k:
                return None
            if self._pays_off(k, d_v, d_p, errors):
                break
        current = load[self._k]
        profile_bound = _per_worker(d_p, self.num_workers - self._k) > _per_worker(d_v, self._k)
        reason = (
            f"{'profile' if profile_bound else 'validate'}-bound: load {current:.2f} -> {load[k]:.2f} "
            f"(validate {d_v:.2f} ± {errors[0]:.2f}, profile {d_p:.2f} ± {errors[1]:.2f} workers of work)"
        )
        self._k = k
        self._last_change = now
        self.history.append((now, k, reason))
        return k

    def _pays_off(self, k: int, d_v: float, d_p: float, errors: tuple[float, float]) -> bool:
        """Whether k_v = k beats the current split by more than `hysteresis` for every demand in the box
        d ± noise_z·error. Loads are homogeneous, so their ratio depends on d_v / d_p only and is
        monotone between the box's extreme ratios and the splits' kinks (d_v / d_p = k / (K - k))."""
        z, n = self.config.noise_z, self.num_workers
        lo_v, hi_v = max(0.0, d_v - z * errors[0]), d_v + z * errors[0]
        lo_p, hi_p = max(0.0, d_p - z * errors[1]), d_p + z * errors[1]
        points = [(lo_v, hi_p), (hi_v, lo_p)]
        points += [
            (j, n - j) for j in (k, self._k) if lo_v * (n - j) <= j * hi_p and j * lo_p <= hi_v * (n - j)
        ]
        keep = 1.0 - self.config.hysteresis
        return all(_bottleneck(k, n, v, p) < keep * _bottleneck(self._k, n, v, p) for v, p in points)

    def _clock(self, now: float) -> None:
        if not math.isfinite(now):
            raise ValueError(f"now={now}: pass a finite timestamp from the caller's clock")
        if now < self._now:
            raise ValueError(
                f"now={now} is earlier than the previous timestamp {self._now}: pass one monotonic clock "
                "(the simulator's virtual time or loop.time()) to every call"
            )
        self._now = now
        if self._start is None:
            self._start = now
            self._last_change = now
            self.history.append((now, self._k, "initial"))


def _check_kind(kind: str) -> Kind:
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r}: pass 'validate' or 'profile'")
    return kind


def _other(kind: Kind) -> Kind:
    return "profile" if kind == "validate" else "validate"


def _per_worker(demand: float, workers: int) -> float:
    if workers > 0:
        return demand / workers
    return math.inf if demand > 0 else 0.0


def _bottleneck(k_v: int, num_workers: int, d_v: float, d_p: float) -> float:
    return max(_per_worker(d_v, k_v), _per_worker(d_p, num_workers - k_v))
