"""The papers' tables as data: settings (presets), budgets, and the papers' own numbers.

One YAML file per paper in `pfedkit/experiments/papers/` (format: docs/results.md, "Paper preset
files"). A table is a grid: columns are settings (config overrides such as a dataset or a
partition's alpha), rows are methods (an algorithm with options, or `algorithm: null` when pfedkit
does not implement it yet), and each cell holds the paper's number for that method in that
setting. A cell's configuration is, lowest precedence first: the paper's `base`, its `baselines`
sections, the table's `config`, the column's, the row's, then the chosen budget's overrides.
"""
from __future__ import annotations

import re
from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pfedkit.config import deep_merge
from pfedkit.core.errors import ConfigError, did_you_mean

# regime: the paper's per-round regime for every client (its local epochs, batch size, lr and samples
# per client), with fewer clients and/or rounds and, optionally, only the rows carrying the claim
BUDGETS = ("smoke", "cpu", "regime", "paper")
PAPERS = ("fedrema", "pfedpm", "cwfedavg", "pfedcs", "dapfl")
# summary.json keys a table may compare with the paper's numbers
METRICS = ("best_acc", "last5_acc", "last10_acc", "final_acc", "best_acc_unweighted", "last5_acc_unweighted",
           "last10_acc_unweighted", "final_acc_unweighted")
_PLUS_MINUS = re.compile(r"^\s*(-?[0-9.]+)\s*%?\s*(?:(?:±|\+-|\+/-)\s*([0-9.]+)\s*%?)?\s*$")


class PaperValue(BaseModel):
    """A number as the paper prints it, in percent: a mean and, when printed, a ± spread."""
    mean: float
    std: float | None = None

    @classmethod
    def parse(cls, value: Any) -> "PaperValue | None":
        if value is None:
            return None
        if isinstance(value, (int, float)):
            return cls(mean=float(value))
        match = _PLUS_MINUS.match(str(value))
        if not match:
            raise ValueError(f"paper value {value!r}: expected a number or 'mean±std' (percent)")
        return cls(mean=float(match.group(1)), std=float(match.group(2)) if match.group(2) else None)

    def text(self) -> str:
        return f"{self.mean:.2f}" + ("" if self.std is None else f" ± {self.std:.2f}")


# what a client does in a round and holds: the settings a `regime` budget keeps (rounds and the
# number of clients it may cut); a paper_says entry may name only these
TRAINING_KEYS = ("local_epochs", "batch_size", "lr", "momentum")
REGIME_KEYS = (*TRAINING_KEYS, "partition.samples_per_client", "partition.k")


class PaperSays(BaseModel):
    """A setting the paper states, in its own words: `quote` (verbatim from the paper's text file)
    must contain `value` as written. A value the paper does not state (the preset's "[ours]" or
    "[code]") has no entry, so it can never pass as the paper's."""
    model_config = ConfigDict(extra="forbid")

    value: float
    quote: str

    @model_validator(mode="after")
    def _value_in_quote(self) -> "PaperSays":
        text = f"{self.value:g}"
        if "[ours]" in self.quote or "[code]" in self.quote:
            raise ValueError(f"paper_says quote {self.quote!r}: a preset's own choice is not the paper's words")
        if not re.search(rf"(?<![0-9.]){re.escape(text)}(?![0-9])", self.quote):
            raise ValueError(f"paper_says value {text}: not in its quote {self.quote!r}; quote the sentence "
                             "that states it, or drop the entry (the paper is silent)")
        return self


def _check_says(says: dict[str, PaperSays]) -> dict[str, PaperSays]:
    strays = [key for key in says if key not in REGIME_KEYS]
    if strays:
        raise ValueError(f"paper_says: {strays} are not per-round settings; allowed: {', '.join(REGIME_KEYS)}")
    return says


class Budget(BaseModel):
    """Overrides that make a table cheaper, the seeds to run, and in words what was reduced."""
    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] = Field(default_factory=dict)
    seeds: int | None = Field(None, ge=1, description="None: the table's number of seeds")
    rows: list[str] | None = Field(None, description="run only these methods (None: every implemented row)")
    columns: list[str] | None = Field(None, description="run only these columns (None: every column)")
    reduced: str = ""


class Column(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    config: dict[str, Any] = Field(default_factory=dict)


class Row(BaseModel):
    """One method of a table. `paper`: one value per column (None where the paper has none)."""
    model_config = ConfigDict(extra="forbid")

    method: str
    algorithm: str | None = Field(..., description="a registered algorithm, or null: not implemented yet")
    config: dict[str, Any] = Field(default_factory=dict, description="row overrides, algorithm sections included")
    metric: str | None = Field(None, description="compare this summary key instead of the table's")
    paper: list[Any]
    note: str = ""

    def values(self) -> list[PaperValue | None]:
        return [PaperValue.parse(value) for value in self.paper]


class Table(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    source: str = Field(..., description="where the numbers are: 'Table 1, MNIST column'")
    caption: str
    metric: str
    seeds: int = Field(1, ge=1, description="the paper's number of seeds (the paper budget runs this many)")
    spread: Literal["seeds", "clients", "none"] = Field(
        "seeds", description="what the paper's ± is: std over seeds (trials) or over clients within a run")
    config: dict[str, Any] = Field(default_factory=dict)
    columns: list[Column]
    rows: list[Row]
    budgets: dict[str, Budget] = Field(default_factory=dict, description="override the paper's budgets")
    paper_says: dict[str, PaperSays] = Field(default_factory=dict, description="over the paper's, for this table")
    quotes_from: str | None = Field(None, description=(
        "the other paper whose printed rows this table reruns (paper provenance) and whose words its "
        "paper_says quote; not among ../shared/papers, so those quotes are not checked against a text"))

    @model_validator(mode="after")
    def _check_shape(self) -> "Table":
        for row in self.rows:
            if len(row.paper) != len(self.columns):
                raise ValueError(f"table {self.id}, row {row.method}: {len(row.paper)} paper values for "
                                 f"{len(self.columns)} columns")
            row.values()
        for metric in [self.metric] + [row.metric for row in self.rows if row.metric]:
            if metric not in METRICS:
                raise ValueError(f"table {self.id}: metric {metric!r}; allowed: {', '.join(METRICS)}")
        return self


class Unavailable(BaseModel):
    """A table of the paper that cannot be rebuilt offline, and why."""
    model_config = ConfigDict(extra="forbid")

    id: str
    source: str
    reason: str


class Paper(BaseModel):
    model_config = ConfigDict(extra="forbid")

    paper: str
    title: str
    file: str = Field(..., description="the paper's text file in ../shared/papers/")
    protocol: str = Field(..., description="how the paper measures: which mean, which round, seeds")
    base: dict[str, Any] = Field(default_factory=dict)
    baselines: dict[str, dict[str, Any]] = Field(default_factory=dict, description="algorithm sections")
    budgets: dict[str, Budget]
    tables: list[Table]
    unavailable: list[Unavailable] = Field(default_factory=list)
    paper_says: dict[str, PaperSays] = Field(default_factory=dict, description=(
        "the per-round settings the paper states (REGIME_KEYS, dotted), each with its quote"))

    @model_validator(mode="after")
    def _check_budgets(self) -> "Paper":
        _check_says(self.paper_says)
        for table in self.tables:
            _check_says(table.paper_says)
        missing = [b for b in ("smoke", "cpu") if b not in self.budgets]
        if missing:
            raise ValueError(f"budgets: {', '.join(missing)} missing")
        unknown = [b for table in self.tables for b in [*self.budgets, *table.budgets] if b not in BUDGETS]
        if unknown or "paper" in self.budgets:
            raise ValueError(f"budgets: {', '.join(unknown) or 'paper'} not allowed; allowed: "
                             f"{', '.join(b for b in BUDGETS if b != 'paper')} (paper is the paper's own setting)")
        for table in self.tables:
            methods, names = [row.method for row in table.rows], [column.name for column in table.columns]
            for name in {*self.budgets, *table.budgets}:
                budget = self.budget(table, name)
                for kind, chosen, allowed in (("rows", budget.rows, methods), ("columns", budget.columns, names)):
                    strays = [item for item in chosen or [] if item not in allowed]
                    if strays:
                        raise ValueError(f"table {table.id}, budget {name}: {kind} {strays} are not in the "
                                         f"table; allowed: {allowed}")
        return self

    def table(self, table_id: str) -> Table:
        """The table `table_id`; ConfigError saying why for a table that cannot be rebuilt, or
        the closest id for a misspelt one."""
        for table in self.tables:
            if table.id == table_id:
                return table
        ids = [t.id for t in self.tables]
        for item in self.unavailable:
            if item.id == table_id:
                raise ConfigError(f"--table {table_id}: {self.paper}'s {item.source} cannot be rebuilt: {item.reason}; "
                                  f"tables that can: {', '.join(ids)}")
        hint = did_you_mean(table_id, ids + [item.id for item in self.unavailable])
        raise ConfigError(f"--table {table_id}: {self.paper} has no such table{hint}; allowed: {', '.join(ids)} "
                          f"(pfedkit reproduce {self.paper} --list)")

    def budget(self, table: Table, name: str) -> Budget:
        """The budget `name` of `table`: the paper-wide one with the table's own merged over it."""
        if name not in BUDGETS:
            raise ConfigError(f"--budget {name}: allowed: {', '.join(BUDGETS)}")
        if name == "paper":
            return Budget(seeds=table.seeds, reduced="none: the paper's setting")
        if name not in self.budgets and name not in table.budgets:
            defined = [b for b in BUDGETS if b == "paper" or b in self.budgets or b in table.budgets]
            raise ConfigError(f"--budget {name}: {self.paper} table {table.id} defines no such budget; "
                              f"allowed: {', '.join(defined)}")
        common, own = self.budgets.get(name, Budget()), table.budgets.get(name, Budget())
        return Budget(config=deep_merge(common.config, own.config), seeds=own.seeds or common.seeds,
                      rows=own.rows if own.rows is not None else common.rows,
                      columns=own.columns if own.columns is not None else common.columns,
                      reduced="; ".join(text for text in (common.reduced, own.reduced) if text))

    def stated(self, table: Table) -> dict[str, PaperSays]:
        """The per-round settings the paper states for `table` (its own over the paper's)."""
        return {**self.paper_says, **table.paper_says}

    def budget_names(self, table: Table) -> list[str]:
        """The budgets `table` can run at, cheapest first."""
        return [b for b in BUDGETS if b == "paper" or b in self.budgets or b in table.budgets]

    def cell_config(self, table: Table, column: Column, row: Row, budget: Budget) -> dict[str, Any]:
        """The configuration of one cell (without seed), lowest precedence first."""
        config: dict[str, Any] = {}
        for layer in (self.base, dict(self.baselines), table.config, column.config, row.config, budget.config):
            config = deep_merge(config, layer)
        config["algorithm"] = row.algorithm
        from pfedkit.algorithms import algorithm_names

        others = set(algorithm_names()) - {row.algorithm}  # other methods' sections: not this run's
        return {key: value for key, value in config.items() if key not in others}


def paper_file(name: str):
    return resources.files("pfedkit.experiments").joinpath("papers", f"{name}.yaml")


def load_paper(name: str) -> Paper:
    """The preset file of paper `name`, validated. ConfigError for an unknown paper or a bad file."""
    if name not in PAPERS:
        raise ConfigError(f"reproduce {name}: unknown paper{did_you_mean(name, PAPERS)}; allowed: {', '.join(PAPERS)}")
    path = paper_file(name)
    if not path.is_file():
        raise ConfigError(f"reproduce {name}: no preset file shipped yet ({name}.yaml)")
    try:
        return Paper(**yaml.safe_load(path.read_text()))
    except ValidationError as err:
        raise ConfigError(f"{name}.yaml: {err}".replace("\n", " ")) from None


def check_paper(paper: Paper) -> list[str]:
    """Every cell of every table and budget validated as a Config; returns the problems found."""
    from pfedkit.algorithms import algorithm_names
    from pfedkit.config import load_config

    problems = []
    for table in paper.tables:
        for row in table.rows:
            if row.algorithm is not None and row.algorithm not in algorithm_names():
                problems.append(f"table {table.id}, row {row.method}: unknown algorithm {row.algorithm!r}")
                continue
            if row.algorithm is None:
                continue
            for budget_name in paper.budget_names(table):
                budget = paper.budget(table, budget_name)
                for column in table.columns:
                    try:
                        load_config(paper.cell_config(table, column, row, budget))
                    except ConfigError as err:
                        problems.append(f"table {table.id}, column {column.name}, row {row.method}, "
                                        f"budget {budget_name}: {err}")
    return problems


def regime_against_paper(paper: Paper, table: Table, budget_name: str = "regime") -> tuple[list[str], set[str]]:
    """Each cell of the budget against the paper's stated per-round values (`paper_says`): the
    mismatches found, and the TRAINING_KEYS the paper does not state (the preset's own choices:
    they keep the paper budget's value, but are not the paper's)."""
    from pfedkit.config import load_config
    from pfedkit.run_identity import flatten

    budget, stated = paper.budget(table, budget_name), paper.stated(table)
    problems = []
    for column in table.columns:
        if budget.columns is not None and column.name not in budget.columns:
            continue
        for row in table.rows:
            if row.algorithm is None or (budget.rows is not None and row.method not in budget.rows):
                continue
            resolved = flatten(load_config(paper.cell_config(table, column, row, budget)).to_dict())
            for key, says in stated.items():
                if resolved.get(key) is None or float(resolved[key]) != says.value:
                    problems.append(f"{paper.paper} {table.id} {column.name} {row.method}: {key} = "
                                    f"{resolved.get(key)}, the paper says {says.value:g} (\"{says.quote}\")")
    return problems, {key for key in TRAINING_KEYS if key not in stated}


def quotes_not_in_text(paper: Paper, text: str) -> list[str]:
    """The paper_says quotes not found in the paper's text (whitespace and case ignored); a table
    quoting another paper (`quotes_from`) is not checked against this one's."""
    def normal(words: str) -> str:
        return " ".join(words.split()).lower()
    body = normal(text)
    says = [*paper.paper_says.items(),
            *(item for table in paper.tables if table.quotes_from is None for item in table.paper_says.items())]
    return [f"{key}: {entry.quote!r}" for key, entry in says if normal(entry.quote) not in body]


if __name__ == "__main__":  # python -m pfedkit.experiments.paper_presets PAPER: validate a preset file
    import sys

    for name in sys.argv[1:] or PAPERS:
        found = check_paper(load_paper(name))
        print(f"{name}: " + ("ok" if not found else f"{len(found)} problems"))
        for problem in found:
            print("  " + problem)
