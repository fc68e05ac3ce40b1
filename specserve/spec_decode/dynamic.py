"""The adaptive draft budget: each step, how many drafts to verify (0 included).

On by default (`speculative_config["adaptive"]`, `num_speculative_tokens` is the maximum K).
The choice maximizes expected tokens per second of the batch:

    k* = argmax_k  sum_r E_r(k) / c(B, k),   E_r(k) = 1 + sum_{j<=k} prod_{i<=j} a_{r,i}

  acceptance  a_{r,i} = P(draft i accepted | drafts < i accepted), per request r: the request's
              own decayed counts shrunk toward its temperature class's (greedy / sampled)
              global estimate, which is shrunk position by position toward the position before
              it (so a probe at k = 1 also moves the deeper positions). Counts decay with the
              engine's decode steps (elapsed steps included), not with the number of
              observations: a batch of 64 and a batch of 1 forget at the same pace. Two scales
              (`two_scale`): counts of the last ~50 steps (`gamma_slow`) unless those of the
              last ~10 (`gamma`) differ from them by more than `change_z` standard errors.
  cost        c(B, k): a low quantile (the second fastest of five) of the last `cost_window`
              measured wall times of steady decode steps (k verified and k proposed) per batch
              bucket (powers of two) and k, counting only samples at most `cost_max_age` of
              the bucket's decisions old; c(B, 0) from plain steps (the tracked k = 0 steps
              below stand in only until one is measured). Not a mean: step-time noise is
              one-sided (a compile, a GC pause, a step the host could not overlap only add
              time), and one stall at k = 0 in an EWMA made plain decoding look up to 1.7x its
              price, so the budget drafted at large k where plain was best and never measured
              k = 0 again to correct it (H100, batch 64, 0.93x plain). The quantile ignores up
              to three stalls in five and follows a real change (contexts growing) within four
              steps; the age limit keeps a k visited long ago from keeping its cheap samples
              of a shorter context. Cells never measured come from a linear fit t0 + k * dt
              over the bucket's measured cells, or, with fewer than two, from the nearest
              measured bucket's shape.
  k = 0       no drafts. For `track_steps` decisions after the last k > 0 (unless that was
              a probe from 0 that found drafting losing) and before the bucket's next probe,
              an autoregressive drafter (EAGLE, EAGLE-3, MTP, a draft model) still runs its
              draft prefill over the verified token, so its KV is complete for a switch back;
              otherwise, and for the other drafters, the drafter does not run on pure decode
              steps (plain decoding's cost) and its KV has holes at the positions decoded
              meanwhile; steps with prompt chunks still run the draft prefill, so every prompt
              is in its KV.
              Tracked steps write only the drafter's KV (`Drafter.write_kv`) but are still
              dearer than plain ones (H100, p50: gpt-oss-20b shape, batch 1, 1.81 against
              1.73 ms; Llama-3-8B shape, batch 64, 7.93 against 7.35), so going down to 0
              must pay for them over `track_horizon` steps, and a bucket whose plain step is
              not measured yet takes k = 0 untracked, to measure it.
              Outputs never depend on drafts (coupled verification), only acceptance right
              after a switch back does.

Exploration: the choice is held for at least two steps (a decision sets the drafts the next
step verifies, so a switch costs one transitional step whose time is not recorded; going up,
that step verifies the old k at the new k's price, so a larger k is taken only when its gain
over `explore_every` steps pays for it, and past the next k only to a k whose cost was
measured in the last `explore_every` decisions: an older sample may come from another speed
of the machine, so the climb goes one k at a time and measures each on the way). Every
`explore_every` decode steps of a bucket, the controller probes the neighbour of its choice
whose cost measurement is oldest (from k = 0: the k >= 1 that would win if the estimates
hold, stale costs included, which also refreshes acceptance), but less often when the probe,
its transitional steps included (from k = 0, also the tracked k = 0 steps before it), is
estimated to lose much: at most `explore_budget` of the time is
spent on expected losses, except that at k = 0 a batch that is mostly requests never drafted
for (at batch 1, a new request) is probed once `explore_every` decisions after the last
probe. The first bucket ever visited starts at the maximum K (acceptance at every position),
then k = 0 (plain decoding's cost); later buckets start from the nearest measured bucket's
cost shape.

Convergence: on the fast scale (gamma = 0.9) observations older than 32 steps weigh 3%, and a
change shows on it within a few steps (a fall from 0.9 to 0 at batch 1 within four steps),
at which point the estimate follows it; a change visible at the current k (acceptance falling,
a batch-size bucket already measured) moves the choice in a few steps, one hidden at k = 0
(acceptance rising) at the next probe (<= 16 steps when the probe is cheap).

Limits: a k is compared with the others at the price it had when last measured. On a machine
whose speed wanders more than the margin between two choices, a k measured in a slow spell
looks dearer than it is until a probe measures it again, and probes are spaced by that same
price. The 2-core CPU this was built on runs the same step at 0.82x-1.33x its median (p10-p90;
benchmarks/RESULTS.md): a batch-6 plain step measured once at 141 ms (75-95 ms most of the
time) kept the budget drafting at 0.82x plain where every K loses.
At batch 1 the estimate rests on one request's ~2 observations a step, so a short request's
own draws decide between near-equal k: over one 512-token request at acceptance 0.6 (Llama-3-8B
shape, H100 step costs) the budget ends more than 5% behind the best fixed K of the same draws
about one time in eight, over 2048 tokens one in a hundred (`benchmarks/budget_sim.py`). Where
drafting gains only a little, an unlucky stretch takes the estimate below break-even and the
budget to k = 0, where the evidence stays at its floor and a probe (~2 plain steps with its
tracked steps) comes ~400 decisions later within `explore_budget`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Acceptance:
    """Decayed counts per draft position on two time scales: reached[i] drafts that got to
    position i, accepted[i] those accepted there, decayed by the fast gamma; `reached_slow`,
    `accepted_slow` the same counts decayed by the slow one; `step` the engine step they were
    last decayed to."""

    reached: np.ndarray
    accepted: np.ndarray
    reached_slow: np.ndarray
    accepted_slow: np.ndarray
    step: int = 0

    @classmethod
    def empty(cls, k: int, step: int = 0) -> _Acceptance:
        return cls(np.zeros(k), np.zeros(k), np.zeros(k), np.zeros(k), step)

    def decay_to(self, step: int, gamma: float, gamma_slow: float, floor: float = 0.0) -> None:
        """Age the counts to `step`. The first position's count never decays below `floor`
        drafts: what was last seen is kept (with less weight) through long stretches without
        drafts, rather than drifting back to the prior. Deeper positions decay to nothing, so
        that a position no longer drafted comes back to its prior, the position before it,
        which fresh drafts keep current: with the floor at every position, two unlucky
        verifications at K = 5 held the third position near 0.2 through 100 steps at k = 2 that
        accepted 0.6, and the budget at k = 2 where K = 4 was best (`benchmarks/budget_sim.py`;
        an H100 cell of that shape held k = 2 at 0.93x of the best K)."""
        if step > self.step:
            for g, reached, accepted in (
                (gamma, self.reached, self.accepted),
                (gamma_slow, self.reached_slow, self.accepted_slow),
            ):
                f = g ** (step - self.step)
                # the first position keeps min(its count, floor) drafts (scalars: no arrays
                # allocated, this runs on the host every step)
                f0 = max(f, min(1.0, floor / reached[0])) if reached[0] > 0 else f
                reached[1:] *= f
                accepted[1:] *= f
                reached[0] *= f0
                accepted[0] *= f0
            self.step = step

    def add(self, reach: np.ndarray, acc: np.ndarray) -> None:
        """[K] drafts that reached and were accepted at each position."""
        for reached, accepted in (
            (self.reached, self.accepted),
            (self.reached_slow, self.accepted_slow),
        ):
            reached += reach
            accepted += acc

    def estimate(self, prior: float, strength: float, z: float, gamma: float) -> np.ndarray:
        """[K] conditional acceptance, each position's counts shrunk toward the estimate of
        the one before it (the first toward `prior`), the slow counts' unless the fast ones
        differ from them by more than `z` standard errors (`two_scale`)."""
        out = np.empty_like(self.reached)
        p = prior
        for i in range(len(out)):
            fast = (self.accepted[i] + strength * p) / (self.reached[i] + strength)
            slow = (self.accepted_slow[i] + strength * p) / (self.reached_slow[i] + strength)
            n_fast = self.reached[i] * (1.0 + gamma) + strength
            # `two_scale` on scalars (plain Python: this runs on the host every step)
            change = (fast - slow) ** 2 * n_fast > z * z * slow * (1.0 - slow)
            p = out[i] = fast if change else slow
        return out


def two_scale(fast: np.ndarray, slow: np.ndarray, n_fast: np.ndarray, z: float) -> np.ndarray:
    """The slow estimate where the fast one agrees with it within `z` standard errors of the
    fast one, else the fast one (a change of regime). `n_fast`: the drafts the fast estimate
    rests on, as a plain count would (decayed counts n with weights gamma^age vary as a count
    of n * (1 + gamma) in a steady state, plus the prior's weight).

    Why two: with acceptance counted over the last ~10 steps only (the fast scale, for
    following a change within ~32 steps), the estimate at batch 1 rests on ~10 drafts: at a
    true rate of 0.3 its standard error is ~0.14, and where drafting gains 5-12% (Llama-3-8B
    shape, batch 1, H100) the budget read drafting as a loss in about a fifth of its decisions
    (simulated: 0.92x of the best fixed K, 0.98x with both scales). The slow scale (~50 steps) gives a steady regime
    its precision, the fast one still moves the estimate as soon as a change shows."""
    var = slow * (1.0 - slow) / n_fast
    return np.where((fast - slow) ** 2 > z * z * var, fast, slow)


@dataclass
class _Costs:
    """Step seconds of one batch bucket per k: a low quantile of the recent samples, sample
    count, step of the last sample. t[0] is plain decoding's step (the drafter not running); k = 0
    steps that still ran the draft prefill (`track_steps`) are a transitional cost after
    drafting, kept apart in `t_tracked` and standing in for t[0] only until a plain step is
    measured."""

    t: np.ndarray
    n: np.ndarray
    last: np.ndarray
    window: int
    max_age: int
    # K + 2 rows (row K + 1: tracked k = 0): the last `window` samples of each k as (bucket
    # decision it was recorded at, seconds), less those over `max_age` decisions old
    recent: list[list[tuple[int, float]]]
    steps: int = 0  # decisions made in this bucket
    probe_at: int = 0  # the decision count at which the next probe may start
    probed: int = 0  # the decision count of the last probe
    t_tracked: float = math.nan
    measured: int = 0  # entries of `table()` measured

    @classmethod
    def empty(cls, k: int, window: int, max_age: int) -> _Costs:
        return cls(
            np.full(k + 1, np.nan),
            np.zeros(k + 1),
            np.full(k + 1, -(10**9)),
            window,
            max_age,
            [[] for _ in range(k + 2)],
        )

    def add(self, row: int, seconds: float) -> float:
        """Record a sample of `row` (k, or K + 1 for tracked k = 0); the cost it gives now: the
        25th percentile of the window, rounded down to a sample (the fastest of up to four),
        over the samples at most `max_age` decisions old. Older ones are dropped: step costs
        drift as contexts grow (at batch 64 on an H100, a k = 2 step went from 9.9 to 13.2 ms
        over 500 tokens), and a rarely visited k kept its cheap samples from a shorter context
        while the k in use was measured at today's price, so it read cheaper than it was.
        (Plain Python: this runs every step on the host, and numpy's nanpercentile alone
        took ~20 us of it.)"""
        q = self.recent[row]
        q.append((self.steps, seconds))
        if len(q) > self.window:
            del q[0]
        oldest = self.steps - self.max_age
        if q[0][0] < oldest:
            q[:] = [x for x in q if x[0] >= oldest]
        vals = sorted(x for _, x in q)
        return vals[(len(vals) - 1) // 4]

    def table(self) -> np.ndarray:
        """[K + 1] the measured costs, t[0] from tracked k = 0 steps while none ran plain."""
        if np.isnan(self.t[0]) and not math.isnan(self.t_tracked):
            t = self.t.copy()
            t[0] = self.t_tracked
            return t
        return self.t

    def count(self) -> None:
        self.measured = int((~np.isnan(self.table())).sum())


@dataclass
class DraftBudget:
    """The controller. Feed it `record_acceptance` per verified request, `record_step` per
    steady decode step, `forget` when a request ends; ask `choose(batch, requests)`."""

    max_k: int
    gamma: float = 0.9  # decay of acceptance counts per engine step (the fast scale)
    request_gamma: float = 0.9
    gamma_slow: float = 0.98  # the slow scale of both (`two_scale`)
    change_z: float = 2.0  # standard errors between the two scales that mean a change
    request_strength: float = 2.0  # prior weight (in drafts) of the class estimate for a request
    position_strength: float = 2.0  # prior weight of position i-1 for position i
    floor: float = 4.0  # drafts of evidence a class's first position keeps however old
    prior_acceptance: float = 0.5
    cost_window: int = 5  # recent step times a cost is a low quantile of
    cost_max_age: int = 32  # decisions of a bucket after which a step time no longer counts
    explore_every: int = 16
    explore_budget: float = 0.005  # fraction of time probes may lose, in expectation
    hold: int = 2  # decisions a choice is kept (one transitional step + one measured step)
    # Decisions after the last k > 0, and before a probe, during which k = 0 still keeps the
    # drafter's KV (its prefill costs ~7% of a batch-1 step on the CPU): short stretches at 0
    # resume drafting from complete KV; long ones, where drafting lost, cost plain decoding's
    # price.
    track_steps: int = 16
    track_horizon: int = 64  # steps over which going down to k = 0 must pay its tracked steps
    classes: dict[bool, _Acceptance] = field(default_factory=dict)
    # Per-request decayed counts, one row a request (`_rows`: request id -> row).
    _rows: dict[str, int] = field(default_factory=dict)
    _free: list[int] = field(default_factory=list)
    _reached: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    _accepted: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    _reached_slow: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    _accepted_slow: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    _row_step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _rows_cache: list[tuple[list[str], np.ndarray]] = field(default_factory=list)
    costs: dict[int, _Costs] = field(default_factory=dict)
    step: int = 0
    last_k: int = -1
    _held: int = 0
    _budget_sum: float = 0.0
    _budget_n: int = 0
    _since_draft: int = 10**9  # decisions since the last k > 0
    _plain_unmeasured: bool = False  # the bucket of the last decision has no plain step yet
    _probed_up: bool = False  # the last k > 0 was a probe from k = 0
    _decided_in: _Costs | None = None  # the bucket of the last decision past its first visit

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()

    # ---- estimates -------------------------------------------------------------------------
    def class_acceptance(self, greedy: bool) -> np.ndarray:
        """[max_k] conditional acceptance of a temperature class (greedy or sampled)."""
        c = self.classes.get(greedy)
        if c is None:
            return np.full(self.max_k, self.prior_acceptance)
        c.decay_to(self.step, self.gamma, self.gamma_slow, self.floor)
        return c.estimate(self.prior_acceptance, self.position_strength, self.change_z, self.gamma)

    def request_acceptance(self, request_id: str, greedy: bool) -> np.ndarray:
        """[max_k] one request's conditional acceptance."""
        return self._request_estimates([request_id], np.array([greedy]))[0]

    def _request_estimates(self, ids: list[str], greedy: np.ndarray) -> np.ndarray:
        """[R, max_k], vectorized: each request's decayed counts shrunk toward its class's.
        (This and `record_acceptances` run on the host every step, so they avoid per-request
        Python work: at batch 64 the controller took 0.46-0.58 ms of a 7-10 ms step, H100 and
        H200.)"""
        n_greedy = int(greedy.sum())
        if 0 < n_greedy < len(ids):
            prior = np.where(
                greedy[:, None], self.class_acceptance(True), self.class_acceptance(False)
            )
        else:
            prior = np.tile(self.class_acceptance(n_greedy > 0), (len(ids), 1))
        rows = self._rows_of(ids, create=False)
        known = rows >= 0
        if known.all():
            r, known = rows, slice(None)
        elif known.any():
            r = rows[known]
        else:
            return prior
        f, f_slow = self._row_decay(r)
        s, p = self.request_strength, prior[known]
        reached = self._reached[r] * f
        fast = (self._accepted[r] * f + s * p) / (reached + s)
        slow = (self._accepted_slow[r] * f_slow + s * p) / (self._reached_slow[r] * f_slow + s)
        n_fast = reached * (1.0 + self.request_gamma) + s
        prior[known] = two_scale(fast, slow, n_fast, self.change_z)
        return prior

    def _rows_of(self, ids: list[str], create: bool) -> np.ndarray:
        """[R] the rows of `ids` (-1: none yet, unless `create`). The batch mostly stays the
        same from step to step, so the last two lists looked up (that of `choose` and that of
        `record_acceptances`) keep their rows until a request is forgotten."""
        for key, rows in self._rows_cache:
            if key == ids:
                return rows
        if create:
            rows = np.fromiter((self._row(r) for r in ids), np.int64, len(ids))
        else:
            get = self._rows.get
            rows = np.fromiter((get(r, -1) for r in ids), np.int64, len(ids))
        if (rows >= 0).all():
            self._rows_cache = [(list(ids), rows), *self._rows_cache[:1]]
        return rows

    def _row_decay(self, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[R, 1] each, the fast and slow decay of rows `r` since their counts were last
        updated (rows keep their counts as of `_row_step`: decayed when read, written only
        when a verification adds)."""
        dt = (self.step - self._row_step[r])[:, None]
        return self.request_gamma**dt, self.gamma_slow**dt

    @staticmethod
    def expected_tokens(acceptance: np.ndarray) -> np.ndarray:
        """[..., K + 1]: E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i for k = 0..K."""
        lead = np.ones((*acceptance.shape[:-1], 1))
        return np.concatenate([lead, 1.0 + np.cumsum(np.cumprod(acceptance, -1), -1)], -1)

    def batch_tokens(self, requests: list[tuple[str, bool]]) -> np.ndarray:
        """[K + 1] expected tokens of one step of the batch for each k: the sum over requests
        of `expected_tokens`, summed before the cumulative sum."""
        if not requests:
            return self.expected_tokens(self.class_acceptance(True))
        ids = [r for r, _ in requests]
        greedy = np.fromiter((g for _, g in requests), bool, len(requests))
        reach = np.cumprod(self._request_estimates(ids, greedy), -1).sum(0)
        return np.concatenate([[0.0], np.cumsum(reach)]) + len(requests)

    def _bucket_costs(self, batch: int) -> _Costs:
        b = self.bucket(batch)
        if b not in self.costs:
            self.costs[b] = _Costs.empty(self.max_k, self.cost_window, self.cost_max_age)
        return self.costs[b]

    def step_costs(self, batch: int) -> np.ndarray | None:
        """[K + 1] seconds per step for each k (measured, else modelled); None: nothing
        measured in any bucket."""
        b = self.bucket(batch)
        own = self.costs.get(b)
        ks = np.arange(self.max_k + 1)
        t = own.table() if own is not None else None
        if own is not None and own.measured >= 2:
            return t if own.measured == len(t) else np.where(np.isnan(t), self._fit(t), t)
        measured = [x for x, c in self.costs.items() if c.measured >= 2]
        if not measured:
            if t is None or np.isnan(t).all():
                return None
            k0 = int(np.flatnonzero(~np.isnan(t))[0])  # one point: 10% a draft
            t0 = t[k0] / (1 + 0.1 * k0)
            return t0 * (1 + 0.1 * ks)
        near = min(measured, key=lambda x: abs(math.log2(x) - math.log2(b)))
        shape = self.step_costs(near)
        assert shape is not None
        if t is None or np.isnan(t).all():
            return shape
        k0 = int(np.flatnonzero(~np.isnan(t))[0])
        return np.where(np.isnan(t), shape * t[k0] / shape[k0], t)

    def _fit(self, t: np.ndarray) -> np.ndarray:
        """[K + 1] the least-squares line t0 + k * dt through the measured cells (dt >= 0)."""
        pts = [(k, x) for k, x in enumerate(t.tolist()) if x == x]  # (Python: ~6 points)
        mx = sum(k for k, _ in pts) / len(pts)
        my = sum(x for _, x in pts) / len(pts)
        slope = sum((k - mx) * (x - my) for k, x in pts) / sum((k - mx) ** 2 for k, _ in pts)
        return my - slope * mx + max(slope, 0.0) * np.arange(self.max_k + 1)

    def values(self, batch: int, requests: list[tuple[str, bool]]) -> np.ndarray | None:
        """[K + 1] expected tokens per second for each k, None before any measurement."""
        t = self.step_costs(batch)
        if t is None:
            return None
        return self.batch_tokens(requests) / np.maximum(t, 1e-12)

    # ---- decisions -------------------------------------------------------------------------
    def choose(self, batch: int, requests: list[tuple[str, bool]]) -> int:
        """The drafts the next step verifies, for a batch of `batch` decode requests given as
        (request id, greedy)."""
        if self._held > 0 and self.last_k >= 0:
            self._held -= 1
            return self._chosen(self.last_k)
        c = self._bucket_costs(batch)
        c.steps += 1
        self._plain_unmeasured = bool(np.isnan(c.t[0]))
        measured = ~np.isnan(c.table())
        t = self.step_costs(batch)
        # Only the first bucket ever visited explores from scratch; later ones start from the
        # nearest bucket's cost shape (`step_costs`) and their own measurements refine it.
        first = not any(x.measured >= 2 for x in self.costs.values())
        if t is None or first and not measured.any():
            return self._decide(self.max_k)  # first visit: every position's acceptance
        if first and not measured[0]:
            return self._decide(0)  # then plain decoding's cost
        self._decided_in = c
        e = self.batch_tokens(requests)
        v = v_all = e / np.maximum(t, 1e-12)
        cur = self.last_k
        if cur >= 0:
            # Climbing past the next k only to a k measured recently: an old sample comes
            # from another speed of the machine (the CPU's slow spells change every step's
            # price by up to 40%) or a shorter context, and read cheap it sent the budget up
            # to k = 3 where it lost. One k at a time, each is measured on the way.
            stale = c.steps - c.last > self.explore_every
            stale[: cur + 2] = False
            v = np.where(stale, -np.inf, v)
        best = int(np.argmax(v))
        if 0 <= cur < best and t[best] > 0:
            # Going up costs a transitional step at the larger k's price that still yields the
            # current k's tokens: worth it only if the gain over `explore_every` steps pays it
            # (no flapping between near-equal choices).
            switch = 1.0 - t[cur] / t[best]
            if (v[best] - v[cur]) / v[best] * self.explore_every <= switch:
                best = cur
        elif best == 0 < cur and not math.isnan(c.t_tracked):
            # Going down to 0 starts `track_steps` tracked steps, each dearer than a plain one
            # (H100, batch 64: +7%): worth it only if plain decoding's gain over
            # `track_horizon` steps pays for them. Where the two are near equal, flapping
            # between them paid the tracked steps every ~20 steps (0.94x of either, simulated).
            track = self.track_steps * max(0.0, c.t_tracked / t[0] - 1.0)
            if (v[0] - v[cur]) / v[0] * self.track_horizon <= track:
                best = cur
        # Most of the batch never drafted for (at batch 1: a new request): its acceptance is
        # the class's guess, so probe as soon as the last probe is `explore_every` old. On
        # the CPU a probe costs ~1.5 plain steps, which spaced the budget's probes ~300 steps
        # apart, and copy prompts that drafting wins ran at k = 0 for 90 steps (0.98x plain
        # where K = 3 ran 1.21x).
        if best == 0 and c.steps >= c.probed + self.explore_every:
            fresh = sum(r not in self._rows for r, _ in requests)
            if fresh * 2 >= max(len(requests), 1):
                c.probe_at = min(c.probe_at, c.steps)
        if c.steps >= c.probe_at:
            probe = self._probe(best, c, v_all)
            c.probed = c.steps
            # Space probes so that their expected loss stays under `explore_budget` of the time.
            loss = self._probe_loss(best, probe, e, t, c) / self.explore_budget
            c.probe_at = c.steps + max(self.explore_every, math.ceil(loss))
            if probe != best:
                self._probed_up = best == 0
                return self._decide(probe)
        if best > 0:
            self._probed_up = False
        return self._decide(best)

    def _probe_loss(
        self, best: int, probe: int, e: np.ndarray, t: np.ndarray, c: _Costs | None = None
    ) -> float:
        """Expected steps lost by a probe of k = `probe` from `best`: the transitional step in
        (it verifies `best` drafts but proposes `probe`, so it costs the larger k's step),
        `hold` steps at `probe`, and the transitional step back. The transitional steps are
        most of it when drafting is dear (from k = 0, the first drafts' step yields one
        token). From k = 0, a probe also costs the `track_steps` k = 0 steps before it that run
        the draft prefill (each dearer than a plain step by the bucket's measured share: on
        the CPU at batch 1 ~10%, as much as the probe itself); left out, probes came every ~20
        steps and those steps took most of the time drafting was off. They are worth their
        price: the probe drafts from complete recent KV. (A variant without them drafted over
        holes; in its one CPU run, copy prompts at batch 1, the budget averaged k = 0.75 and
        ran 0.94x plain where K = 3 ran 1.28x.)"""
        if probe == best:
            return 0.0
        v_best = e[best] / t[best]
        wide = t[max(best, probe)]
        steps_in = 1.0 - e[best] / wide / v_best
        at = 1.0 - e[probe] / t[probe] / v_best
        steps_out = 1.0 - e[probe] / wide / v_best
        loss = max(0.0, steps_in) + self.hold * max(0.0, at) + max(0.0, steps_out)
        if best == 0 and c is not None and not math.isnan(c.t_tracked) and not np.isnan(c.t[0]):
            loss += self.track_steps * max(0.0, c.t_tracked / c.t[0] - 1.0)
        return loss

    def _probe(self, best: int, c: _Costs, v: np.ndarray) -> int:
        """The k to probe from `best`, given [K + 1] the expected tokens a second `v`. From 0:
        the k >= 1 that would win if the estimates hold (stale costs included: the probe
        measures it again). Step costs are concave (the first draft dearest: the drafter's
        prefill), so where k = 1 loses to plain decoding a deeper k can still win; probed at
        k = 1 alone, the budget stayed at 0 on copy prompts on the CPU (k = 1 1.75x a plain
        step, k = 3 1.95x: 0.96x plain where K = 3 ran 1.06x). Else: the neighbour of `best`
        measured longest ago."""
        if best == 0:
            return 1 + int(np.argmax(v[1:])) if self.max_k >= 1 else 0
        near = [k for k in (best - 1, best + 1) if 0 <= k <= self.max_k]
        return min(near, key=lambda k: c.last[k])

    def _decide(self, k: int) -> int:
        if k != self.last_k:
            self._held = self.hold - 1
        self.last_k = k
        return self._chosen(k)

    def _chosen(self, k: int) -> int:
        self._budget_sum += k
        self._budget_n += 1
        self._since_draft = 0 if k > 0 else self._since_draft + 1
        return k

    @property
    def tracks_drafter_kv(self) -> bool:
        """Whether the k = 0 just chosen should keep the drafter's KV (see `track_steps`): in
        the `track_steps` decisions after drafting, so that a short stretch at 0 resumes from
        complete KV, and in those before the bucket's next probe, so that the probe measures
        acceptance over complete recent KV. Not after a probe from k = 0 that found drafting
        still losing: the next switch up is then the next probe, which the steps before it
        serve, and tracking the steps after each probe as well made tracked steps ~80% of
        the steps of requests that drafting loses at batch 1 (a new request is probed within
        `explore_every` decisions; its prompt, prefilled by the drafter, has no holes).
        Not while the bucket has no plain step measured: a tracked step stands in for plain
        decoding's cost until one is, and it is dearer (H100, batch 64: 7.39 ms against 6.92),
        so k = 0 looked worse than it was, was never held long enough to be measured, and the
        budget drafted where plain decoding won. The price: the drafter's KV misses the
        positions of the untracked steps (acceptance, never outputs)."""
        if self._plain_unmeasured:
            return False
        after = self._since_draft <= self.track_steps and not self._probed_up
        c = self._decided_in
        return after or c is not None and c.probe_at - c.steps <= self.track_steps

    @property
    def mean_budget(self) -> float:
        """Mean drafts chosen per decision since the start."""
        return self._budget_sum / self._budget_n if self._budget_n else float(self.max_k)

    # ---- observations ----------------------------------------------------------------------
    def tick(self) -> None:
        """One engine decode step has passed (the clock of every decay)."""
        self.step += 1

    def record_step(self, batch: int, k: int, seconds: float, tracked: bool = False) -> None:
        """A steady decode step (k drafts verified and k proposed) of `batch` requests took
        `seconds` of wall time; `tracked`: a k = 0 step that ran the draft prefill."""
        c = self._bucket_costs(batch)
        if k == 0 and tracked:
            c.t_tracked = c.add(self.max_k + 1, seconds)
            c.last[0] = c.steps
        else:
            c.t[k] = c.add(k, seconds)
            c.n[k] += 1
            c.last[k] = c.steps
        c.count()

    def record_acceptance(
        self, request_id: str, greedy: bool, num_draft: int, num_accepted: int
    ) -> None:
        """One request's verification: positions < num_accepted accepted, the next rejected."""
        self.record_acceptances([request_id], [greedy], [num_draft], [num_accepted])

    def record_acceptances(
        self,
        ids: list[str],
        greedy: list[bool],
        num_draft: list[int],
        num_accepted: list[int],
    ) -> None:
        """A step's verifications, one entry a request (vectorized)."""
        nd, na = np.asarray(num_draft), np.asarray(num_accepted)
        g = np.asarray(greedy, dtype=bool)
        drafted = nd > 0
        if not drafted.all():
            if not drafted.any():
                return
            ids = [r for r, d in zip(ids, drafted) if d]
            nd, na, g = nd[drafted], na[drafted], g[drafted]
        pos = np.arange(self.max_k)
        # [R, K] positions each verification reached and accepted
        reach = pos < np.minimum(na + 1, nd)[:, None]
        acc = pos < na[:, None]
        n_greedy = int(g.sum())
        for cls, n in ((True, n_greedy), (False, len(g) - n_greedy)):
            if n == 0:
                continue
            c = self.classes.setdefault(cls, _Acceptance.empty(self.max_k, self.step))
            c.decay_to(self.step, self.gamma, self.gamma_slow, self.floor)
            m = slice(None) if n == len(g) else (g if cls else ~g)
            c.add(reach[m].sum(0), acc[m].sum(0))
        # One entry a request in a step's verifications: the rows are distinct.
        rows = self._rows_of(ids, create=True)
        f, f_slow = self._row_decay(rows)
        self._reached[rows] = self._reached[rows] * f + reach
        self._accepted[rows] = self._accepted[rows] * f + acc
        self._reached_slow[rows] = self._reached_slow[rows] * f_slow + reach
        self._accepted_slow[rows] = self._accepted_slow[rows] * f_slow + acc
        self._row_step[rows] = self.step

    def _row_counts(self) -> tuple[np.ndarray, ...]:
        """[rows, K] each: reached and accepted on the fast scale, then on the slow one."""
        return self._reached, self._accepted, self._reached_slow, self._accepted_slow

    def _row(self, request_id: str) -> int:
        row = self._rows.get(request_id)
        if row is not None:
            return row
        if not self._free:
            n = len(self._row_step)
            grow = max(16, n)
            more = np.zeros((grow, self.max_k))
            self._reached, self._accepted, self._reached_slow, self._accepted_slow = (
                np.concatenate([x.reshape(n, self.max_k), more]) for x in self._row_counts()
            )
            self._row_step = np.concatenate([self._row_step, np.zeros(grow, dtype=np.int64)])
            self._free = list(range(n + grow - 1, n - 1, -1))
        row = self._rows[request_id] = self._free.pop()
        for x in self._row_counts():
            x[row] = 0
        self._row_step[row] = self.step
        return row

    def forget(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            self._rows_cache = []
