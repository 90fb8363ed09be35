"""The plain-text table of run summaries that `pfedkit run` and `pfedkit flower simulate | local`
print after a run (one row per summary.json)."""
from __future__ import annotations


def results_table(summaries: list[dict]) -> str:
    """One row per run summary: headline, final, last-5 and best accuracy, best round, MB uploaded and
    seconds, then the headline's definition and how the other columns are computed."""
    header = (f"{'algorithm':<12} {'headline':>9} {'final acc':>9} {'last-5 acc':>10} {'best acc':>8} "
              f"{'best round':>10} {'MB up':>8} {'seconds':>8}")
    lines = [header, "-" * len(header)]
    for s in summaries:
        lines.append(f"{s['algorithm']:<12} {_pct(s.get('headline_acc')):>9} {_pct(s['final_acc']):>9} "
                     f"{_pct(s['last5_acc']):>10} {_pct(s['best_acc']):>8} {str(s['best_round']):>10} "
                     f"{s['bytes_up'] / 1e6:>8.2f} {s['seconds']:>8.1f}")
    headlines = sorted({s.get("headline", "") for s in summaries} - {""})
    lines.append("headline: " + " | ".join(headlines) if headlines else "")
    lines.append("other columns: sample-weighted mean over clients' test splits; best round is chosen on test data")
    return "\n".join(line for line in lines if line)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"
