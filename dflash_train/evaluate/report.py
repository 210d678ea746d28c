"""The evaluation report: per-sample outputs in, pooled numbers out (JSON, a table, a PNG).

Everything aggregate is computed from the per-sample records, never stored alongside
them, so a report read back from JSON, or merged with a re-run of its failed samples,
gives exactly the numbers a single clean run would. Failed samples contribute nothing;
while any remain, every aggregate is marked provisional (it covers fewer samples than
were asked for).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from dflash_train.evaluate.counters import COUNTER_DEFINITIONS, AcceptanceCounters, first_difference
from dflash_train.evaluate.requests import RequestFailure
from dflash_train.evaluate.wer import NORMALIZER, WerResult, corpus_wer

TARGET_ONLY = "target_only"


@dataclass
class Generation:
    """One decoded output: tokens (stop token included), why it ended, text, accepted proposals per round."""

    token_ids: list[int]
    finish_reason: str
    text: str
    accepted_per_round: list[int] = field(default_factory=list)


@dataclass
class SampleResult:
    """One evaluated sample: the target-only output and each draft's speculative output."""

    index: int
    id: str
    reference: str
    target: Generation
    drafts: dict[str, Generation]

    def first_mismatch(self, name: str) -> Optional[int]:
        """First output position where draft ``name``'s tokens differ from the target's, or ``None``."""
        return first_difference(self.target.token_ids, self.drafts[name].token_ids)


class ReportMismatch(ValueError):
    """Two reports cannot be merged: different settings or overlapping samples."""


@dataclass
class EvalReport:
    """Settings, expected sample count, evaluated samples and failures of one evaluation."""

    settings: dict
    expected: int
    samples: list[SampleResult]
    failures: list[RequestFailure]

    @property
    def k(self) -> int:
        return int(self.settings["num_speculative_tokens"])

    @property
    def draft_names(self) -> list[str]:
        return list(self.settings["drafts"])

    @property
    def provisional(self) -> bool:
        """Aggregates cover fewer samples than expected (some failed): not final numbers."""
        return bool(self.failures) or len(self.samples) != self.expected

    def counters(self, name: str) -> AcceptanceCounters:
        """Draft ``name``'s counters pooled over every round of every evaluated sample."""
        return AcceptanceCounters.from_rounds(
            self.k, [n for sample in self.samples for n in sample.drafts[name].accepted_per_round]
        )

    def generation(self, sample: SampleResult, name: str) -> Generation:
        return sample.target if name == TARGET_ONLY else sample.drafts[name]

    def truncated(self, name: str) -> list[str]:
        """Ids whose output hit ``max_new_tokens`` before a stop token."""
        return [s.id for s in self.samples if self.generation(s, name).finish_reason == "length"]

    def mismatches(self, name: str) -> dict[str, int]:
        """``{sample id: first differing position}`` where speculation changed the greedy output."""
        found = {s.id: s.first_mismatch(name) for s in self.samples}
        return {sid: pos for sid, pos in found.items() if pos is not None}

    def wer(self, name: str) -> WerResult:
        gens = [self.generation(s, name) for s in self.samples]
        return corpus_wer([s.id for s in self.samples], [g.text for g in gens], [s.reference for s in self.samples])

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        """The JSON document: aggregates first, then every sample and failure."""
        drafts = {}
        for name in self.draft_names:
            counters = self.counters(name)
            drafts[name] = {
                "export": self.settings["drafts"][name],
                "acceptance": counters.to_dict(),
                "generated_tokens": sum(len(s.drafts[name].token_ids) for s in self.samples),
                "greedy_equal": not self.mismatches(name),
                "mismatches": [{"id": k, "first_differing_position": v} for k, v in self.mismatches(name).items()],
                "truncated_ids": self.truncated(name),
                "wer": self.wer(name).to_dict(),
            }
        return {
            "tool": "dflash-eval",
            "provisional": self.provisional,
            "settings": self.settings,
            "counter_definitions": COUNTER_DEFINITIONS,
            "samples_expected": self.expected,
            "samples_evaluated": len(self.samples),
            "failures": [asdict(f) for f in self.failures],
            "target_only": {
                "generated_tokens": sum(len(s.target.token_ids) for s in self.samples),
                "truncated_ids": self.truncated(TARGET_ONLY),
                "wer": self.wer(TARGET_ONLY).to_dict(),
            },
            "drafts": drafts,
            "samples": [asdict(s) for s in self.samples],
        }

    def write_json(self, path: str | Path) -> Path:
        """Strict JSON: an undefined rate (0/0, e.g. conditional@k after no acceptance) is ``null``."""
        return write_strict_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> "EvalReport":
        samples = [
            SampleResult(
                index=s["index"],
                id=s["id"],
                reference=s["reference"],
                target=Generation(**s["target"]),
                drafts={name: Generation(**g) for name, g in s["drafts"].items()},
            )
            for s in data["samples"]
        ]
        failures = [RequestFailure(**f) for f in data["failures"]]
        return cls(data["settings"], int(data["samples_expected"]), samples, failures)

    @classmethod
    def read_json(cls, path: str | Path) -> "EvalReport":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
            raise ReportMismatch(f"'{path}' is not a dflash-eval report ({type(err).__name__}: {err})") from None

    def merged_with(self, rerun: "EvalReport") -> "EvalReport":
        """This report with ``rerun`` (its failed samples, evaluated again under identical settings) folded in."""
        if rerun.settings != self.settings:
            raise ReportMismatch("the re-run used different settings; only identical settings can be merged")
        done = {s.index for s in self.samples}
        overlap = sorted(s.id for s in rerun.samples if s.index in done)
        if overlap:
            raise ReportMismatch(f"samples {overlap} were already evaluated; a re-run covers failed samples only")
        samples = sorted([*self.samples, *rerun.samples], key=lambda s: s.index)
        return EvalReport(self.settings, self.expected, samples, rerun.failures)

    def format_table(self) -> str:
        """A readable summary: per-draft numbers side by side, per-position acceptance, failures."""
        s = self.settings
        names = self.draft_names
        status = "PROVISIONAL (failed samples excluded) " if self.provisional else ""
        lines = [
            f"dflash-eval {status}on {s['target']['description']}: {len(self.samples)} of {self.expected} samples "
            f"evaluated, {len(self.failures)} failed; K={self.k}, max_new_tokens={s['max_new_tokens']}, "
            f"{s['dtype']} (perception {s.get('perception_dtype', s['dtype'])}) on {s['device']}, greedy",
            "",
            f"{'':24}" + "".join(f"{name:>16}" for name in names),
        ]
        counters = {name: self.counters(name) for name in names}
        total = len(self.samples)

        def row(label: str, values) -> str:
            return f"{label:24}" + "".join(f"{v:>16}" for v in values)

        steps = s.get("draft_training_steps") or {}
        lines += [
            row("export at step", [steps.get(n) if steps.get(n) is not None else "?" for n in names]),
            row("MAL (pooled)", [f"{counters[n].mal:.3f}" for n in names]),
            row("draft rounds", [counters[n].rounds for n in names]),
            row("proposed tokens", [counters[n].proposed for n in names]),
            row("accepted tokens", [counters[n].accepted for n in names]),
            row("generated tokens", [sum(len(x.drafts[n].token_ids) for x in self.samples) for n in names]),
            row("greedy-equal samples", [f"{total - len(self.mismatches(n))}/{total}" for n in names]),
            row("truncated samples", [len(self.truncated(n)) for n in names]),
            row("WER speculative", [_percent(self.wer(n).wer) for n in names]),
            "",
            f"WER target-only {_percent(self.wer(TARGET_ONLY).wer)} ({NORMALIZER}); "
            f"target-only truncated at max_new_tokens: {len(self.truncated(TARGET_ONLY))}",
            "",
            "per-position acceptance: unconditional accepted@k/proposed@k, conditional accepted@k/accepted@k-1",
            f"{'k':>3}" + "".join(f"{name + ' uncond.':>20}{name + ' cond.':>20}" for name in names),
        ]
        for k in range(1, self.k + 1):
            cells = [counters[n].positions()[k - 1] for n in names]
            lines.append(f"{k:>3}" + "".join(f"{p.rate:>20.3f}{p.conditional:>20.3f}" for p in cells))
        for n in names:
            if self.mismatches(n):
                lines.append(f"GREEDY MISMATCH ({n}): first differing position by sample {self.mismatches(n)}")
        if self.failures:
            lines.append("failed samples (excluded from every number above; re-run with --rerun-failed):")
            lines += [f"  {f.id} (#{f.index}): {f.error}" for f in self.failures]
        lines.append("counters:")
        lines += [f"  {key}: {text}" for key, text in COUNTER_DEFINITIONS.items()]
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """PNG of per-position acceptance, unconditional and conditional, one line per draft."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        ks = list(range(1, self.k + 1))
        for name in self.draft_names:
            counters = self.counters(name)
            positions = counters.positions()
            label = f"{name} (MAL {counters.mal:.2f})"
            axes[0].plot(ks, [p.rate for p in positions], marker="o", label=label)
            axes[1].plot(ks, [p.conditional for p in positions], marker="o", label=label)
        axes[0].set_title("accepted@k / proposed@k")
        axes[1].set_title("conditional: accepted@k / accepted@k-1")
        for ax in axes:
            ax.set_xlabel("draft position k")
            ax.set_xticks(ks)
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("acceptance")
        axes[0].legend()
        note = " (PROVISIONAL)" if self.provisional else ""
        fig.suptitle(f"per-position acceptance, K={self.k}, {len(self.samples)} samples{note}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def write_strict_json(path: str | Path, document: dict) -> Path:
    """Write ``document`` as strict, indented JSON (NaN as ``null``), creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nan_to_none(document), indent=2, allow_nan=False))
    return path


def nan_to_none(value):
    """``value`` with every NaN (an undefined rate) replaced by ``None``: what strict JSON can hold."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nan_to_none(v) for v in value]
    return value


def _percent(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.2f}%"
