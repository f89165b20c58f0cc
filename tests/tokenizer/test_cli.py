"""``k3serve tokenize``."""

from __future__ import annotations

import numpy as np

from k3serve.cli import main


def test_counts(tmp_path, capsys, tok):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Hello, world! 你好 <|im_end|>", encoding="utf-8")
    b.write_text("def f(x):\n    return x * 2\n", encoding="utf-8")
    assert main(["tokenize", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    na, nb = tok.count(a.read_text()), tok.count(b.read_text())
    assert lines == [f"{na}\t{a}", f"{nb}\t{b}", f"{na + nb}\ttotal"]


def test_encode_and_specials(tmp_path, capsys, tok):
    f = tmp_path / "p.txt"
    f.write_text("hi<|im_end|>", encoding="utf-8")
    assert main(["tokenize", "--encode", str(f)]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in tok.encode("hi<|im_end|>").tolist()]
    assert main(["tokenize", "--encode", "--allow-special", str(f)]) == 0
    assert capsys.readouterr().out.split()[-1] == "163586"


def test_large_file_in_steps_is_exact(tmp_path, tok):
    text = ("word " * 7 + "\n") * 130_000 + "tail" * 20_000  # > 1.6M characters: chunked, with progress
    f = tmp_path / "big.txt"
    f.write_text(text, encoding="utf-8")
    out = tmp_path / "ids.npy"
    assert main(["tokenize", str(f), "-o", str(out)]) == 0
    ids = np.load(out)
    assert ids.dtype == np.uint32 and ids.tolist() == tok.encode(text).tolist()


def test_errors(tmp_path, capsys):
    assert main(["tokenize", str(tmp_path / "missing.txt")]) == 1
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe bad")
    assert main(["tokenize", str(bad)]) == 1
    assert "not UTF-8" in capsys.readouterr().err
