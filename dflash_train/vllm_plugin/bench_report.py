"""The serving benchmark's report: measured requests in, throughput, latency and acceptance out.

``dflash-serve-bench`` (:mod:`dflash_train.vllm_plugin.bench`) serves the same requests
with the target alone and with each draft, at each concurrency, ``repeats`` times. This
module holds what it measured, request by request, and derives every aggregate from those
records (nothing aggregate is stored), as JSON, a Markdown table and a PNG. vLLM-free.

Scoping: warm-up requests are never recorded. A request that failed (rejected by the
engine, or finished without ``stop``/``length``) contributes to no latency, token count,
acceptance counter, equality check or WER. Acceptance is pooled from vLLM's per-request
spec-decode metrics of the completed requests, so a failed request's partial rounds are
excluded exactly; the engine-wide counters over the same phase are kept as a cross-check.
A running server (``--endpoint``) exposes no per-request rounds: there acceptance is the
server's counter difference over each phase, attributed to the measured requests only when the
server finished exactly those requests meanwhile (``Phase.counters_attributed``; otherwise
failed requests or other traffic are in it and the row is provisional).
Throughput divides completed requests' tokens by the phase's wall time, which includes
whatever time failed requests took: with any failure it is marked provisional.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from dflash_train.errors import InputFileError
from dflash_train.evaluate.counters import COUNTER_DEFINITIONS, AcceptanceCounters
from dflash_train.evaluate.report import write_strict_json
from dflash_train.evaluate.requests import RequestFailure
from dflash_train.evaluate.wer import NORMALIZER, corpus_wer

TARGET_ONLY = "target_only"
COMPLETED = ("stop", "length")
PERCENTILES = (50, 90, 99)


@dataclass
class ServedRequest:
    """One measured request: output, finish reason, timings (seconds from its submission) and rounds."""

    id: str
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    latency: float  # submission to last token
    ttft: float  # submission to first token (NaN if none came)
    accepted_per_round: Optional[list[int]] = None  # vLLM's per-request spec-decode metrics (detailed)
    drafted_per_round: Optional[list[int]] = None

    @property
    def completed(self) -> bool:
        return self.finish_reason in COMPLETED

    @property
    def tpot(self) -> float:
        """Time per output token after the first: ``(latency - ttft) / (tokens - 1)`` (NaN for one token)."""
        n = len(self.token_ids)
        return (self.latency - self.ttft) / (n - 1) if n > 1 else float("nan")


@dataclass
class Phase:
    """All requests served once by one configuration's engine at one concurrency (one repeat)."""

    config: str
    concurrency: int
    repeat: int
    seconds: float  # first submission to last finish
    requests: list[ServedRequest]
    rejected: list[RequestFailure] = field(default_factory=list)  # refused by the engine when submitted
    engine_counters: Optional[dict] = None  # vLLM's engine-wide counter deltas over the phase (AcceptanceCounters fields)
    counters_attributed: Optional[bool] = None  # endpoint mode: the server finished exactly the measured requests

    def completed(self) -> list[ServedRequest]:
        return [r for r in self.requests if r.completed]

    def failed_ids(self) -> list[str]:
        return [f.id for f in self.rejected] + [r.id for r in self.requests if not r.completed]


@dataclass
class ServedConfig:
    """One way of serving: the target alone, or with a draft (method, export, K)."""

    name: str
    method: Optional[str] = None  # None (target only), "dflash", "eagle3", "mtp"
    export: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    training_step: Optional[int] = None
    unservable: Optional[str] = None  # why the installed vLLM could not start this configuration


@dataclass
class Summary:
    """The aggregates of one configuration at one concurrency (see :meth:`ServeBenchReport.summary`)."""

    config: str
    concurrency: int
    evaluated: int
    failed_ids: list[str]
    truncated: int
    output_tokens_per_s: float
    per_user_tokens_per_s: float  # interactivity: the median request's output tokens / its latency
    requests_per_s: float
    throughput_per_repeat: list[float]
    latency: dict[str, float]
    ttft: dict[str, float]
    tpot: dict[str, float]
    acceptance: Optional[dict]
    engine_counters_match: Optional[bool]
    greedy_equal: Optional[str]  # "n/m" requests equal to target-only at the same concurrency
    mismatched_ids: list[str]
    wer: dict
    speedup: Optional[float]
    speedup_per_repeat: list[float]
    provisional: bool


@dataclass
class ServeBenchReport:
    """Settings, selected requests (references and data failures), configurations and measured phases."""

    settings: dict
    references: dict[str, str]  # request id -> reference reply, every request served
    data_failures: list[RequestFailure]
    configs: list[ServedConfig]
    phases: list[Phase]

    @property
    def expected(self) -> int:
        return len(self.references) + len(self.data_failures)

    @property
    def concurrencies(self) -> list[int]:
        return list(self.settings["concurrency"])

    def config(self, name: str) -> ServedConfig:
        return next(c for c in self.configs if c.name == name)

    def served(self) -> list[ServedConfig]:
        return [c for c in self.configs if c.unservable is None]

    def phases_of(self, config: str, concurrency: int) -> list[Phase]:
        return sorted(
            (p for p in self.phases if p.config == config and p.concurrency == concurrency), key=lambda p: p.repeat
        )

    def counters(self, config: str, concurrency: int) -> Optional[AcceptanceCounters]:
        """Acceptance pooled over the completed requests of every repeat (greedy decoding makes the repeats'
        tokens equal, but batching can split rounds differently, so no repeat stands for the others); from a
        server, which reports no per-request rounds, the sum of every repeat's counter differences."""
        spec = self.config(config)
        phases = self.phases_of(config, concurrency)
        if spec.num_speculative_tokens is None or not phases:
            return None
        if self.counters_from_server(config):
            if any(p.engine_counters is None for p in phases):
                return None
            return AcceptanceCounters.pooled(spec.num_speculative_tokens,
                                             (AcceptanceCounters(**p.engine_counters) for p in phases))
        counters = AcceptanceCounters(spec.num_speculative_tokens)
        for phase in phases:
            for request in phase.completed():
                for drafted, accepted in zip(request.drafted_per_round or [], request.accepted_per_round or []):
                    counters.observe(drafted, accepted)
        return counters

    def counters_from_server(self, config: str) -> bool:
        """Whether ``config``'s acceptance comes from a server's counters (endpoint mode) rather than per request."""
        return any(p.counters_attributed is not None for p in self.phases if p.config == config)

    def stops_paying(self, config: str, rows: Optional[list[Summary]] = None) -> Optional[int]:
        """The lowest measured concurrency at which ``config`` serves fewer output tokens/s than target-only at
        the same concurrency (speed-up below 1); ``None`` when it pays at every one (or nothing compares).
        ``rows``: :meth:`summaries` when the caller has them already."""
        rows = self.summaries() if rows is None else rows
        return next((s.concurrency for s in rows if s.config == config and s.speedup is not None and s.speedup < 1.0),
                    None)

    def summary(self, config: str, concurrency: int) -> Summary:
        """Throughput (median over repeats; per user: the median request's tokens/s), latency percentiles and
        acceptance (every repeat's completed requests), greedy equality and WER (first repeat), speed-up over
        target-only."""
        phases = self.phases_of(config, concurrency)
        if not phases:
            raise KeyError(f"no measurement of {config} at concurrency {concurrency}")
        first = phases[0]
        completed = [r for p in phases for r in p.completed()]
        failed = sorted({rid for p in phases for rid in p.failed_ids()})
        tps = [sum(len(r.token_ids) for r in p.completed()) / p.seconds for p in phases]
        rps = [len(p.completed()) / p.seconds for p in phases]
        counters = self.counters(config, concurrency)
        engine_match = None
        if counters is not None and not self.counters_from_server(config) and all(
                p.engine_counters is not None for p in phases):
            engine_match = (sum(p.engine_counters["rounds"] for p in phases),
                            sum(p.engine_counters["accepted"] for p in phases)) == (counters.rounds, counters.accepted)
        greedy, mismatched = None, []
        if config != TARGET_ONLY and self.phases_of(TARGET_ONLY, concurrency):
            reference = {r.id: r.token_ids for r in self.phases_of(TARGET_ONLY, concurrency)[0].completed()}
            both = [r for r in first.completed() if r.id in reference]
            mismatched = [r.id for r in both if r.token_ids != reference[r.id]]
            greedy = f"{len(both) - len(mismatched)}/{len(both)}"
        speedup, per_repeat = None, []
        baseline = self.phases_of(TARGET_ONLY, concurrency)
        if config != TARGET_ONLY and baseline:
            base = [sum(len(r.token_ids) for r in p.completed()) / p.seconds for p in baseline]
            speedup = _ratio(statistics.median(tps), statistics.median(base))
            per_repeat = [_ratio(a, b) for a, b in zip(tps, base)]
        wer = corpus_wer(
            [r.id for r in first.completed()],
            [r.text for r in first.completed()],
            [self.references.get(r.id, "") for r in first.completed()],
        )
        return Summary(
            config=config,
            concurrency=concurrency,
            evaluated=len(first.completed()),
            failed_ids=failed,
            truncated=sum(r.finish_reason == "length" for r in first.completed()),
            output_tokens_per_s=statistics.median(tps),
            per_user_tokens_per_s=statistics.median([len(r.token_ids) / r.latency for r in completed if r.latency > 0])
            if completed else float("nan"),
            requests_per_s=statistics.median(rps),
            throughput_per_repeat=tps,
            latency=_percentiles([r.latency for r in completed]),
            ttft=_percentiles([r.ttft for r in completed]),
            tpot=_percentiles([r.tpot for r in completed if not math.isnan(r.tpot)]),
            acceptance=counters.to_dict() if counters is not None else None,
            engine_counters_match=engine_match,
            greedy_equal=greedy,
            mismatched_ids=mismatched,
            wer=wer.to_dict(),
            speedup=speedup,
            speedup_per_repeat=per_repeat,
            provisional=bool(failed or self.data_failures) or engine_match is False
            or any(p.counters_attributed is False for p in phases),
        )

    def adopt_baseline(self, baseline: "ServeBenchReport") -> None:
        """Take the target-only configuration and measurements of an earlier report of the same requests
        (:func:`check_comparable` first) as this report's baseline: speed-up and greedy equality use them."""
        if any(c.name == TARGET_ONLY for c in self.configs):
            raise ValueError("this report measured its own target-only baseline")
        self.configs.insert(0, baseline.config(TARGET_ONLY))
        self.phases = [p for p in baseline.phases if p.config == TARGET_ONLY] + self.phases

    def summaries(self) -> list[Summary]:
        return [self.summary(c.name, n) for c in self.served() for n in self.concurrencies if self.phases_of(c.name, n)]

    @property
    def provisional(self) -> bool:
        return any(s.provisional for s in self.summaries())

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        """The JSON document: settings, per configuration x concurrency aggregates, then every request."""
        rows = self.summaries()
        return {
            "tool": "dflash-serve-bench",
            "provisional": any(s.provisional for s in rows),
            "settings": self.settings,
            "counter_definitions": COUNTER_DEFINITIONS,
            "samples_expected": self.expected,
            "data_failures": [asdict(f) for f in self.data_failures],
            "configs": [asdict(c) for c in self.configs],
            "summaries": [asdict(s) for s in rows],
            "references": self.references,
            "phases": [asdict(p) for p in self.phases],
        }

    def write_json(self, path: str | Path) -> Path:
        """Strict JSON (undefined numbers are ``null``), keys in a stable order, so two runs diff line by line."""
        return write_strict_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> "ServeBenchReport":
        phases = [
            Phase(
                **{
                    **p,
                    "requests": [ServedRequest(**{**r, "ttft": _none_to_nan(r["ttft"])}) for r in p["requests"]],
                    "rejected": [RequestFailure(**f) for f in p["rejected"]],
                }
            )
            for p in data["phases"]
        ]
        return cls(
            data["settings"],
            data["references"],
            [RequestFailure(**f) for f in data["data_failures"]],
            [ServedConfig(**c) for c in data["configs"]],
            phases,
        )

    @classmethod
    def read_json(cls, path: str | Path) -> "ServeBenchReport":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def markdown(self) -> str:
        """The deployment table: one row per configuration and concurrency, then notes and failures."""
        s = self.settings
        k_values = sorted({c.num_speculative_tokens for c in self.served() if c.num_speculative_tokens})
        rows = self.summaries()
        provisional = any(summary.provisional for summary in rows)
        status = " — PROVISIONAL (failed requests excluded)" if provisional else ""
        if s.get("mode") == "endpoint":
            servers = ", ".join(f"{name} `{url}`" for name, url in s["endpoints"].items())
            where = (f"Running servers ({servers}; vLLM {s.get('vllm_version') or '?'}), model `{s['target']}`, "
                     f"{len(self.references)} of {self.expected} requests from `{s['input']}`, greedy, max "
                     f"{s['max_tokens']} tokens, streamed, {s['repeats']} repeat(s) (servers interleaved), "
                     f"{s['warmup']} warm-up request(s) per server (not measured)"
                     + (f"; target-only from `{s['baseline_report']}`" if s.get("baseline_report") else "") + ".")
        else:
            where = (f"Target `{s['target']}`, {len(self.references)} of {self.expected} requests from `{s['input']}`, "
                     f"greedy, max {s['max_tokens']} tokens, {s['dtype']} on {s['device']}, vLLM "
                     f"{s.get('vllm_version', '?')}, {s['repeats']} repeat(s) (configurations interleaved), "
                     f"{s['warmup']} warm-up request(s) per engine (not measured), engine `max_num_seqs` "
                     f"{s['max_num_seqs']}.")
        lines = [
            f"# dflash-serve-bench{status}",
            "",
            where,
            "",
            "| config | export step | K | concurrency | output tok/s | per-user tok/s | req/s | speed-up "
            "| latency p50 / p90 / p99 (s) | TTFT p50 (s) | TPOT p50 (ms) | MAL | acceptance@1..K | greedy = target "
            "| WER | evaluated / expected | failed | truncated |",
            "|" + "---|" * 18,
        ]
        for summary in rows:
            config = self.config(summary.config)
            acceptance = summary.acceptance
            mal = f"{acceptance['mal']:.3f}" if acceptance and acceptance["rounds"] else "—"
            per_position = (
                " ".join(_fmt(p["acceptance"], "{:.2f}") for p in acceptance["per_position"]) if acceptance else "—"
            )
            mark = " (provisional)" if summary.provisional else ""
            lines.append(
                f"| {summary.config}{mark} | {_fmt(config.training_step, '{}')} | {_fmt(config.num_speculative_tokens, '{}')} "
                f"| {summary.concurrency} | {summary.output_tokens_per_s:.1f} "
                f"| {_fmt(summary.per_user_tokens_per_s, '{:.1f}')} | {summary.requests_per_s:.2f} "
                f"| {_fmt(summary.speedup, '{:.2f}x')} | "
                + " / ".join(_fmt(summary.latency[f"p{q}"], "{:.3f}") for q in PERCENTILES)
                + f" | {_fmt(summary.ttft['p50'], '{:.3f}')} | {_fmt(summary.tpot['p50'] * 1e3, '{:.1f}')} | {mal} "
                f"| {per_position} | {summary.greedy_equal or '—'} | {_fmt(summary.wer['wer'] * 100, '{:.2f} %')} "
                f"| {summary.evaluated} / {self.expected} | {len(summary.failed_ids)} | {summary.truncated} |"
            )
        notes = [f"- **{c.name}** not served: {c.unservable}" for c in self.configs if c.unservable]
        notes += self.pays_lines(rows)
        for summary in rows:
            if summary.mismatched_ids:
                notes.append(f"- {summary.config} at concurrency {summary.concurrency}: output differs from "
                             f"target-only on {', '.join(summary.mismatched_ids)}")
            if any(p.counters_attributed is False for p in self.phases_of(summary.config, summary.concurrency)):
                notes.append(f"- {summary.config} at concurrency {summary.concurrency}: the server finished other "
                             "requests than the measured ones during the phase (other traffic or failures): its "
                             "counters are not these requests' alone")
            if summary.engine_counters_match is False:
                notes.append(f"- {summary.config} at concurrency {summary.concurrency}: vLLM's engine-wide counters "
                             "include rounds of failed requests; MAL above is scoped to the completed ones")
            if summary.failed_ids:
                notes.append(f"- {summary.config} at concurrency {summary.concurrency}: failed {', '.join(summary.failed_ids)}")
        notes += [f"- data failure {f.id} (#{f.index}): {f.error}" for f in self.data_failures]
        if provisional:
            notes.append(f"- re-run the failed requests under the same settings: `{self.rerun_command(rows)}`")
        if notes:
            lines += ["", *notes]
        lines += [
            "",
            "Speed-up: median output tokens/s over repeats divided by target-only's at the same concurrency, "
            "measured in this run; per repeat: "
            + "; ".join(
                f"{s.config}@{s.concurrency} " + ", ".join(f"{x:.2f}" for x in s.speedup_per_repeat)
                for s in rows if s.speedup_per_repeat
            ) + ".",
            (f"MAL and acceptance@k from the server's spec-decode counters (Prometheus /metrics), their difference "
             f"over each phase summed over repeats; a phase in which the server finished other requests too is "
             f"provisional (K={'/'.join(map(str, k_values)) or '—'})"
             if any(self.counters_from_server(c.name) for c in self.served()) else
             f"MAL and acceptance@k pooled over the completed requests' draft rounds (vLLM per-request "
             f"spec-decode metrics; K={'/'.join(map(str, k_values)) or '—'})")
            + f"; acceptance@k = accepted@k / proposed@k. WER after {NORMALIZER}.",
        ]
        return "\n".join(lines) + "\n"

    def pays_lines(self, rows: list[Summary]) -> list[str]:
        """Per draft: up to which concurrency speculation pays (speed-up over target-only above 1)."""
        lines = []
        for config in self.served():
            speedups = [(s.concurrency, s.speedup) for s in rows if s.config == config.name and s.speedup is not None]
            if config.name == TARGET_ONLY or not speedups:
                continue
            curve = ", ".join(f"{x:.2f}x at {c}" for c, x in speedups)
            stop = self.stops_paying(config.name, rows)
            verdict = (f"stops paying at concurrency {stop}" if stop is not None
                       else "pays at every measured concurrency")
            lines.append(f"- **{config.name}**: speculation {verdict} ({curve})")
        return lines

    def rerun_command(self, rows: Optional[list[Summary]] = None) -> str:
        """The command that serves exactly the failed requests again under these settings (same ids);
        ``rows``: :meth:`summaries` when the caller has them already."""
        rows = self.summaries() if rows is None else rows
        failed = sorted({rid for s in rows for rid in s.failed_ids} | {f.id for f in self.data_failures})
        return " ".join([*self.settings["command"], *[f"--sample-id {rid}" for rid in failed]])

    def plot(self, path: str | Path) -> Path:
        """PNG: acceptance per position (each draft, lowest concurrency) and the latency distribution of every row."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, (acc, lat, curve) = plt.subplots(1, 3, figsize=(19, 4.5))
        lowest = min(self.concurrencies)
        for config in self.served():
            counters = self.counters(config.name, lowest)
            if counters is None or not counters.rounds:
                continue
            ks = [p.k for p in counters.positions()]
            line, = acc.plot(ks, [p.rate for p in counters.positions()], marker="o",
                             label=f"{config.name} (MAL {counters.mal:.2f})")
            acc.plot(ks, [p.conditional for p in counters.positions()], ls="--", color=line.get_color())
        acc.set(title=f"acceptance@k (solid) and conditional (dashed), concurrency {lowest}",
                xlabel="draft position k", ylabel="acceptance", ylim=(0, 1.05))
        acc.grid(alpha=0.3)
        if acc.lines:
            acc.legend()
        summaries = self.summaries()
        rows = [(s.config, s.concurrency) for s in summaries]
        data = [[r.latency for p in self.phases_of(c, n) for r in p.completed()] for c, n in rows]
        lat.boxplot(data, whis=(1, 99), showfliers=True)
        lat.set_xticks(range(1, len(rows) + 1), [f"{c}\n@{n}" for c, n in rows], fontsize=8)
        lat.set(title="request latency (whiskers p1-p99)", ylabel="seconds")
        lat.grid(alpha=0.3, axis="y")
        for config in self.served():
            points = [s for s in summaries if s.config == config.name]
            if not points:
                continue
            curve.plot([s.per_user_tokens_per_s for s in points], [s.output_tokens_per_s for s in points], marker="o",
                       label=config.name)
            for s in points:
                curve.annotate(str(s.concurrency), (s.per_user_tokens_per_s, s.output_tokens_per_s), fontsize=7,
                               textcoords="offset points", xytext=(3, 3))
        curve.set(title="throughput vs interactivity (labels: concurrency)", xlabel="per-user output tokens/s",
                  ylabel="total output tokens/s")
        curve.grid(alpha=0.3)
        if curve.lines:
            curve.legend()
        note = " (PROVISIONAL)" if any(s.provisional for s in summaries) else ""
        fig.suptitle(f"dflash-serve-bench: {len(self.references)} requests, {self.settings['device']}{note}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


COMPARED_SETTINGS = ("input", "max_tokens", "dtype", "prompt_format", "system_prompt")
"""Settings two reports must share to be compared (with the sample ids and each shared configuration's K)."""


def _refusal(names: tuple[str, str], field: str, left, right) -> InputFileError:
    return InputFileError(f"{names[0]} and {names[1]} differ in {field} ({left!r} vs {right!r}): compare reports "
                          "of identical sample ids, prompts, decoding limits, precision and K")


def check_comparable(a: ServeBenchReport, b: ServeBenchReport, names: tuple[str, str] = ("A", "B")) -> None:
    """:class:`InputFileError` naming the first differing field unless ``a`` and ``b`` served identical sample
    ids, input, decoding limit, precision, prompt format and system prompt."""
    ids = [sorted([*r.references, *(f.id for f in r.data_failures)]) for r in (a, b)]
    if ids[0] != ids[1]:
        only = sorted(set(ids[0]) ^ set(ids[1]))
        raise _refusal(names, "sample ids", f"{len(ids[0])} ids", f"{len(ids[1])} ids, e.g. {only[0]} in one only")
    for key in COMPARED_SETTINGS:
        if a.settings.get(key) != b.settings.get(key):
            raise _refusal(names, key, a.settings.get(key), b.settings.get(key))


def compare_reports(a: ServeBenchReport, b: ServeBenchReport, names: tuple[str, str] = ("A", "B")) -> str:
    """The delta table of report ``b`` against report ``a`` (a baseline and an adapted draft, say), per shared
    configuration and concurrency: MAL, acceptance per position, throughput, latency, WER, and the sample ids
    whose greedy output differs between the two. :class:`InputFileError` naming the first differing field when
    the two did not serve identical sample ids, inputs, limits, precision or K."""
    check_comparable(a, b, names)
    shared = [c.name for c in a.served() if c.name in {x.name for x in b.served()}]
    for name in shared:
        if a.config(name).num_speculative_tokens != b.config(name).num_speculative_tokens:
            raise _refusal(names, f"K of {name}", a.config(name).num_speculative_tokens,
                           b.config(name).num_speculative_tokens)
    lines = [f"# dflash-serve-bench compare: {names[1]} against {names[0]}", "",
             "| config | concurrency | MAL | Δ acceptance@1..K | output tok/s | latency p50 (s) | WER | greedy differs |",
             "|---|---:|---|---|---|---|---|---|"]
    for name in shared:
        for concurrency in [c for c in a.concurrencies if c in b.concurrencies]:
            if not (a.phases_of(name, concurrency) and b.phases_of(name, concurrency)):
                continue
            left, right = a.summary(name, concurrency), b.summary(name, concurrency)
            mal = "—"
            if left.acceptance and right.acceptance:
                mal = (f"{left.acceptance['mal']:.3f} → {right.acceptance['mal']:.3f} "
                       f"({right.acceptance['mal'] - left.acceptance['mal']:+.3f})")
                deltas = " ".join(f"{q['acceptance'] - p['acceptance']:+.2f}" for p, q in
                                  zip(left.acceptance["per_position"], right.acceptance["per_position"]))
            else:
                deltas = "—"
            outputs = [{r.id: r.token_ids for r in x.phases_of(name, concurrency)[0].completed()} for x in (a, b)]
            differs = sorted(i for i in outputs[0].keys() & outputs[1].keys() if outputs[0][i] != outputs[1][i])
            lines.append(
                f"| {name} | {concurrency} | {mal} | {deltas} | {left.output_tokens_per_s:.1f} → "
                f"{right.output_tokens_per_s:.1f} ({_fmt(_ratio(right.output_tokens_per_s, left.output_tokens_per_s), '{:.2f}x')}) "
                f"| {_fmt(left.latency['p50'], '{:.3f}')} → {_fmt(right.latency['p50'], '{:.3f}')} "
                f"| {_fmt(left.wer['wer'] * 100, '{:.2f} %')} → {_fmt(right.wer['wer'] * 100, '{:.2f} %')} "
                f"| {', '.join(differs) or 'none'} |")
    only = sorted({c.name for c in a.served()} ^ {c.name for c in b.served()})
    if only:
        lines += ["", f"Served in one report only (not compared): {', '.join(only)}."]
    return "\n".join(lines) + "\n"


def _percentiles(values: list[float]) -> dict[str, float]:
    """``p50``/``p90``/``p99`` and the mean (linear interpolation; NaN without values)."""
    if not values:
        return {**{f"p{q}": float("nan") for q in PERCENTILES}, "mean": float("nan")}
    ordered = sorted(values)
    out = {}
    for q in PERCENTILES:
        pos = (len(ordered) - 1) * q / 100
        low, high = math.floor(pos), math.ceil(pos)
        out[f"p{q}"] = ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
    out["mean"] = statistics.fmean(ordered)
    return out


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def _fmt(value, pattern: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return pattern.format(value)


def _none_to_nan(value):
    return float("nan") if value is None else value
