"""Counting shapes in a generated image: a verifiable vision-language task small enough for CPU.

Why this task: a VLM run must show that the model reads its image -- the answer is in the
pixels, not in the text (every question of a kind is the same words) -- with a rule reward and
a tiny model on two CPU cores. An ``84x84`` RGB image is a ``3x3`` grid of ``28px`` cells, each
empty or holding one coloured square or disk (jittered inside its cell, never overlapping);
the answer is how many cells hold a shape. With Qwen2.5-VL's ``14px`` patches and ``2x2``
merge each cell is exactly one of the image's 9 tokens, so the prompt stays short (~20 tokens).

``difficulty`` is the largest count (1..9, counts uniform in ``1..difficulty``);
``colour_rate`` is the share of questions that ask for one colour's count (answer 0 possible),
the harder kind. Rows (``train.jsonl`` / ``test.jsonl``, images under ``images/``)::

    {"id": "test-000017", "images": ["images/test-000017.png"], "prompt": "<image> How many shapes ?",
     "answer": "3", "solution": "#### 3", "count": 3, "colour": ""}

``train.parquet`` / ``test.parquet`` hold the same rows with the images as ``datasets`` Image
structs (``{"bytes", "path"}``) and a conversational prompt (``{"type": "image"}`` part), the
other way users bring image data. The answer format is the ``arithmetic`` task's, so its
reward (the integer after the last ``####``) checks it.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

GENERATOR_VERSION = 1
SIZE, CELL = 84, 28
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40)}
BACKGROUND = (245, 245, 240)
QUESTION = "How many shapes ?"
WORDS = ["How", "many", "shapes", *COLOURS]  # the task's vocabulary (see experiments.tasks.vl_tokenizer)


@dataclass(frozen=True)
class Scene:
    """What one image shows: (cell, colour, kind) per shape; ``kind`` is ``square`` or ``disk``."""
    shapes: tuple[tuple[int, str, str], ...]

    def count(self, colour: str = "") -> int:
        return sum(1 for _, c, _ in self.shapes if not colour or c == colour)


def sample_scene(rng: random.Random, difficulty: int) -> Scene:
    """1..``difficulty`` shapes in distinct cells, each a random colour and kind."""
    n = rng.randint(1, difficulty)
    cells = sorted(rng.sample(range(9), n))
    return Scene(tuple((c, rng.choice(sorted(COLOURS)), rng.choice(("square", "disk"))) for c in cells))


def render_png(scene: Scene, rng: random.Random) -> bytes:
    """The scene as PNG bytes: each shape 12..20px, jittered inside its 28px cell."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for cell, colour, kind in scene.shapes:
        side = rng.randint(12, 20)
        x0 = (cell % 3) * CELL + rng.randint(2, CELL - side - 2)
        y0 = (cell // 3) * CELL + rng.randint(2, CELL - side - 2)
        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        (draw.rectangle if kind == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def generate_split(prefix: str, n: int, seed: int, difficulty: int,
                   colour_rate: float = 0.0) -> list[tuple[dict, bytes]]:
    """``n`` (row, PNG bytes) pairs, a pure function of the arguments (the split's own RNG)."""
    if not 1 <= difficulty <= 9:
        raise ValueError(f"shapes_count: difficulty (the largest count) must be in 1..9, got {difficulty}")
    if n < 1 or not 0.0 <= colour_rate <= 1.0:
        raise ValueError(f"shapes_count: need n >= 1 and 0 <= colour_rate <= 1, got n={n}, colour_rate={colour_rate}")
    rng = random.Random(f"shapes-{prefix}:{seed}:{difficulty}")
    out = []
    for i in range(n):
        scene = sample_scene(rng, difficulty)
        png = render_png(scene, rng)
        colour = rng.choice(sorted(COLOURS)) if rng.random() < colour_rate else ""
        question = f"How many {colour} shapes ?" if colour else QUESTION
        rid = f"{prefix}-{i:06d}"
        answer = str(scene.count(colour))
        out.append(({"id": rid, "images": [f"images/{rid}.png"], "prompt": f"<image> {question}",
                     "answer": answer, "solution": f"#### {answer}", "count": scene.count(), "colour": colour}, png))
    return out


@dataclass(frozen=True)
class ShapesDataset:
    """Where :func:`ensure_dataset` put the files (the parquet copies hold the same rows)."""
    train: str
    test: str
    train_parquet: str
    test_parquet: str
    images: str
    manifest: str


def _write_parquet(path: Path, rows: list[tuple[dict, bytes]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": [r["id"] for r, _ in rows],
        "images": [[{"bytes": png, "path": r["images"][0]}] for r, png in rows],
        "prompt": [[{"role": "user", "content": [{"type": "image", "text": None},
                                                  {"type": "text", "text": r["prompt"].replace("<image> ", "")}]}]
                   for r, _ in rows],
        "answer": [r["answer"] for r, _ in rows],
        "solution": [r["solution"] for r, _ in rows],
    })
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def ensure_dataset(out_dir: str | os.PathLike, n_train: int, n_test: int, seed: int, difficulty: int,
                   colour_rate: float = 0.0) -> ShapesDataset:
    """Write the images, ``train/test.jsonl`` and ``train/test.parquet`` under ``out_dir`` unless its
    manifest records the same parameters and every file still has the recorded digest.

    Idempotent: the content is a pure function of the arguments, files are replaced atomically."""
    out = Path(out_dir)
    img_dir = out / "images"
    names = ("train.jsonl", "test.jsonl", "train.parquet", "test.parquet")
    paths = ShapesDataset(*(str(out / n) for n in names), str(img_dir), str(out / "manifest.json"))
    params = {"generator": "shapes_count", "version": GENERATOR_VERSION, "n_train": n_train, "n_test": n_test,
              "seed": seed, "difficulty": difficulty, "colour_rate": colour_rate}
    man_p = Path(paths.manifest)
    try:
        man = json.loads(man_p.read_text())
        files = [out / n for n in names] + [img_dir / f for f in man["images"]]
        if man.get("params") == params and man.get("sha256") == _digest(files):
            return paths
    except (OSError, ValueError, KeyError):
        pass
    img_dir.mkdir(parents=True, exist_ok=True)
    splits = {"train": generate_split("train", n_train, seed, difficulty, colour_rate),
              "test": generate_split("test", n_test, seed, difficulty, colour_rate)}
    images = []
    for name, rows in splits.items():
        for row, png in rows:
            (img_dir / f"{row['id']}.png").write_bytes(png)
            images.append(f"{row['id']}.png")
        tmp = out / f"{name}.jsonl.tmp{os.getpid()}"
        tmp.write_text("".join(json.dumps(r) + "\n" for r, _ in rows))
        os.replace(tmp, out / f"{name}.jsonl")
        _write_parquet(out / f"{name}.parquet", rows)
    files = [out / n for n in names] + [img_dir / f for f in images]
    tmp = man_p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"params": params, "images": images, "sha256": _digest(files)}, indent=1))
    os.replace(tmp, man_p)
    return paths


def ensure_tokenizer(out_dir: str | os.PathLike) -> str:
    """The task's word-level VL tokenizer (:mod:`experiments.tasks.vl_tokenizer`) under ``out_dir``."""
    from experiments.tasks.vl_tokenizer import ensure_vl_tokenizer

    return ensure_vl_tokenizer(out_dir, WORDS)


__all__ = ["Scene", "sample_scene", "render_png", "generate_split", "ensure_dataset", "ensure_tokenizer",
           "ShapesDataset", "WORDS", "COLOURS", "GENERATOR_VERSION"]
