"""AG News as token ids (pfedkit/data/text.py) and the fasttext model, on a tiny CSV fixture served
by a replaced `download.download`: deterministic tokenisation, exact round trip, a 2-round run."""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io

import numpy as np
import pytest
import torch

from pfedkit.cli import main
from pfedkit.data import download as download_module
from pfedkit.data import fetch as fetch_module
from pfedkit.data import sources
from pfedkit.data import text
from pfedkit.data.datasets import load_dataset
from pfedkit.engine.state import read_checkpoint
from pfedkit.models import build_model
from pfedkit.runs import run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOPICS = {1: "war election minister treaty", 2: "goal match team season",
          3: "stocks profit market shares", 4: "software chip internet space"}


def csv_bytes(count: int, seed: int) -> tuple[bytes, list[list[str]]]:
    """AG News layout: "class index 1-4","title","description", quoted, with the CSVs' escapes."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        label = i % 4 + 1
        words = TOPICS[label].split() + ["the", "of"]
        title = " ".join(rng.choice(words, 3)).title()
        description = f"Reuters - {' '.join(rng.choice(words, 6 + i % 5))}, Wall Street#39;s \\band, \"quoted\" #36;{i}"
        rows.append([str(label), title, description])
    rows.append(["2", "Long " * 300, "tail"])  # longer than MAX_LENGTH: cut
    buffer = io.StringIO()
    csv.writer(buffer, quoting=csv.QUOTE_ALL, lineterminator="\n").writerows(rows)
    return buffer.getvalue().encode(), rows


@pytest.fixture
def served(monkeypatch):
    """train.csv / test.csv as the network's answer (published MD5s = the fixture's)."""
    train, train_rows = csv_bytes(60, 0)
    test, test_rows = csv_bytes(16, 1)
    files = {"train.csv": train, "test.csv": test}
    source = sources.SOURCES["ag_news"]
    items = tuple(dataclasses.replace(i, md5=hashlib.md5(files[i.filename]).hexdigest()) for i in source.files)
    monkeypatch.setitem(sources.SOURCES, "ag_news", dataclasses.replace(source, files=items))
    calls = []

    def download(url, part, offset, progress):
        name = url.rsplit("/", 1)[-1]
        calls.append(name)
        with open(part, "ab") as handle:
            handle.write(files[name][offset:])
        progress(len(files[name]), len(files[name]))

    monkeypatch.setattr(download_module, "download", download)
    return train_rows, test_rows, calls


def test_tokenize_lowercases_splits_words_and_undoes_the_csv_escapes():
    assert text.tokenize("Wall St. Bears (Reuters) - Short-sellers, Wall Street#39;s dwindling\\band &quot;Q3&quot; #36;5") \
        == ["wall", "st", "bears", "reuters", "short", "sellers", "wall", "street's", "dwindling", "band", "q3", "5"]


def test_vocab_is_by_count_then_alphabetical_whatever_the_row_order():
    documents = [["b", "a", "c"], ["a", "b"], ["a", "d", "d"], ["e"]]
    vocab = text.build_vocab(documents, min_count=2)
    assert vocab == ["<pad>", "<unk>", "a", "b", "d"]  # a:3, b:2, d:2 (b before d), c and e once
    assert text.build_vocab(documents[::-1], min_count=2) == vocab
    assert text.build_vocab(documents, min_count=1, max_size=4) == ["<pad>", "<unk>", "a", "b"]


def test_encode_pads_cuts_and_maps_unknown_words():
    vocab = ["<pad>", "<unk>", "x", "y"]
    ids = text.encode([["x", "zzz", "y"], ["y"] * 7, []], vocab, max_length=5)
    assert ids.tolist() == [[2, 1, 3, 0, 0], [3, 3, 3, 3, 3], [0, 0, 0, 0, 0]]


def test_fetch_round_trips_every_row_and_is_deterministic(served, tmp_path, capsys):
    train_rows, test_rows, calls = served
    root = tmp_path / "data"
    assert main(["data", "fetch", "ag_news", "--data-dir", str(root), "-q"]) == 0
    assert sorted(calls) == ["test.csv", "train.csv"]
    target = root / "ag_news" / "ag_news.npz.xz"
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    assert f"{digest}  ag_news/ag_news.npz.xz" in (root / "SHA256SUMS").read_text().splitlines()

    data = load_dataset("ag_news", str(root), cache_dir=str(tmp_path / "cache"))
    rows = train_rows + test_rows
    assert data.stored.shape == (len(rows), text.MAX_LENGTH) and data.stored.dtype == np.int32
    assert data.y.tolist() == [int(r[0]) - 1 for r in rows]
    assert data.official_test.tolist() == [False] * len(train_rows) + [True] * len(test_rows)
    assert data.class_names == ("World", "Sports", "Business", "Sci/Tech") and data.num_classes == 4
    known = set(data.vocab)
    train_counts = {}
    for row in train_rows:
        for token in text.tokenize(" ".join(row[1:])):
            train_counts[token] = train_counts.get(token, 0) + 1
    assert known - {"<pad>", "<unk>"} == {t for t, c in train_counts.items() if c >= text.MIN_COUNT}
    for ids, row in zip(data.stored, rows):
        expected = [t if t in known else "<unk>" for t in text.tokenize(" ".join(row[1:]))][:text.MAX_LENGTH]
        assert [data.vocab[i] for i in ids[:len(expected)]] == expected
        assert not ids[len(expected):].any()  # padding after the text only
    assert data.rows(np.array([0, 3])).dtype == np.int32  # token ids stay integers for the model

    again = tmp_path / "again"
    assert main(["data", "fetch", "ag_news", "--data-dir", str(again), "-q"]) == 0
    assert (again / "ag_news" / "ag_news.npz.xz").read_bytes() == target.read_bytes()
    calls.clear()
    assert main(["data", "fetch", "ag_news", "--data-dir", str(root)]) == 0
    assert calls == [] and "already present" in capsys.readouterr().err


def test_a_broken_csv_is_refused_in_one_line(served, tmp_path, monkeypatch, capsys):
    bad = b'"9","title","class 9 does not exist"\n'
    source = sources.SOURCES["ag_news"]
    items = (dataclasses.replace(source.files[0], md5=hashlib.md5(bad).hexdigest()), source.files[1])
    monkeypatch.setitem(sources.SOURCES, "ag_news", dataclasses.replace(source, files=items))
    real = download_module.download
    monkeypatch.setattr(download_module, "download", lambda url, part, offset, progress: (
        part.write_bytes(bad) if url.endswith("train.csv") else real(url, part, offset, progress)))
    assert main(["data", "fetch", "ag_news", "--data-dir", str(tmp_path / "data"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "class index 1..4" in err
    assert not (tmp_path / "data" / "ag_news" / "ag_news.npz.xz").exists()


def test_fasttext_mean_ignores_padding_and_splits_body_and_head():
    torch.manual_seed(0)
    model = build_model("fasttext", (6,), 4, embed_dim=5, vocab_size=10)
    short = torch.tensor([[3, 4, 0, 0, 0, 0]])
    embedding = model.body.embedding.embedding.weight
    assert torch.allclose(model.body.embedding(short), (embedding[3] + embedding[4]) / 2)
    assert torch.allclose(model.body.embedding(torch.zeros(1, 6, dtype=torch.long)), torch.zeros(1, 5))
    assert model.feature_dim == 5 and [n for n, _ in model.head.named_children()] == ["fc"]
    assert torch.allclose(model(short), model.head(model.body(short)))
    fc_split = build_model("fasttext", (6,), 4, head="fc", embed_dim=5, vocab_size=10)
    assert [n for n, _ in fc_split.head.named_children()] == ["fc1", "fc"]
    with pytest.raises(ValueError, match="token-id inputs"):
        build_model("fasttext", (1, 8, 8), 4)


@pytest.mark.parametrize("backend", ["sequential", "vectorized"])
def test_two_rounds_on_ag_news_learn_the_fixture(served, tmp_path, backend):
    root = tmp_path / "data"
    fetch_module.fetch("ag_news", str(root), progress=False)
    config = {"dataset": "ag_news", "data_dir": str(root), "num_clients": 3, "rounds": 2, "threads": 1,
              "lr": 0.5, "batch_size": 8, "seed": 1, "backend": backend, "out_dir": str(tmp_path / "runs"),
              "partition": {"scheme": "dirichlet", "alpha": 1.0}}
    result = run(config)
    assert result.summary["model"] == "fasttext"
    # The fixture's topics share no words: two rounds must beat chance (25%) by far.
    assert result.summary["final_acc"] > 0.6


def _checkpoint(run_dir):
    return read_checkpoint(run_dir / "checkpoints" / "latest.pt").state


def test_fedper_shares_the_fasttext_body_and_keeps_each_head(served, tmp_path):
    """fasttext's body/head split under FedPer: the server holds exactly the body (embedding + fc1)
    and averages it as FedAvg does; each client keeps its own head (fc), which is never averaged."""
    root = tmp_path / "data"
    fetch_module.fetch("ag_news", str(root), progress=False)
    base = {"dataset": "ag_news", "data_dir": str(root), "num_clients": 3, "threads": 1, "lr": 0.5,
            "batch_size": 8, "seed": 1, "backend": "sequential", "out_dir": str(tmp_path / "runs"),
            "partition": {"scheme": "dirichlet", "alpha": 1.0}}
    for name, algorithm, rounds in (("avg1", "fedavg", 1), ("per1", "fedper", 1), ("per2", "fedper", 2)):
        run({**base, "algorithm": algorithm, "rounds": rounds, "name": name})
    runs = tmp_path / "runs"
    body = {"body.embedding.embedding.weight", "body.fc1.weight", "body.fc1.bias"}
    head = {"head.fc.weight", "head.fc.bias"}

    # Round 1 starts every client from the same model under both algorithms, so the local training
    # is the same: FedPer's body is FedAvg's averaged body, and FedAvg's head is the n_i-weighted
    # mean of FedPer's private heads (which FedPer never averages).
    fedavg, fedper = _checkpoint(runs / "avg1").server["params"], _checkpoint(runs / "per1")
    assert set(fedper.server["shared"]) == body
    for key in body:
        assert torch.allclose(fedper.server["shared"][key], fedavg[key], atol=1e-6), key
    with np.load(runs / "per1" / "partition.npz") as saved:
        weights = torch.tensor([len(saved[f"train_{c}"]) for c in range(3)], dtype=torch.float64)
    weights = weights / weights.sum()
    for key in head:
        mean = sum(w * client["private"][key].double() for w, client in zip(weights, fedper.clients))
        assert torch.allclose(mean.float(), fedavg[key], atol=1e-6), key

    # After two rounds: one shared body on the server, three different personal heads.
    state = _checkpoint(runs / "per2")
    assert set(state.server["shared"]) == body and all(set(c["private"]) == head for c in state.clients)
    heads = [c["private"]["head.fc.weight"] for c in state.clients]
    assert all(not torch.equal(heads[i], heads[j]) for i in range(3) for j in range(i + 1, 3))
    from pfedkit.algorithms import get_algorithm

    client_model = get_algorithm("fedper").client_model  # the evaluated model; it reads no hyperparameter
    models = [client_model(None, c, state.server, client) for c, client in enumerate(state.clients)]
    for key in body:  # every client evaluates the same body ...
        assert all(torch.equal(models[0][key], m[key]) for m in models[1:])
    for model, client in zip(models, state.clients):  # ... with its own head
        assert all(torch.equal(model[key], client["private"][key]) for key in head)
