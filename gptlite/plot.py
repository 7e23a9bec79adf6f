"""Loss curves from a run's metrics.jsonl to a PNG, with numpy and the standard library only.

    python -m gptlite.plot OUT_DIR [--out=loss.png]      # writes OUT_DIR/loss.png by default

Train loss is drawn in blue, val loss in orange (with a dot per evaluation), on linear axes labelled with a
built-in 3x5 pixel font, so no plotting library (or its fonts) is needed.
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import numpy as np

from gptlite.metrics import METRICS_FILE, read_metrics

WIDTH, HEIGHT = 800, 500
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 50  # margins around the plot area, in pixels
SCALE = 2  # font pixels per glyph pixel
BLUE, ORANGE, BLACK, GREY = (31, 119, 180), (255, 127, 14), (0, 0, 0), (220, 220, 220)
# 3x5 glyphs: five rows top to bottom, each an octal digit whose three bits are the pixels left to right
FONT = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717", "6": "74757",
    "7": "71122", "8": "75757", "9": "75717", ".": "00002", "-": "00700", "+": "02720", "_": "00007",
    "/": "11244", ":": "02020", " ": "00000",
    "A": "25755", "B": "65656", "C": "74447", "D": "65556", "E": "74747", "F": "74744", "G": "74557",
    "H": "55755", "I": "72227", "J": "11157", "K": "55655", "L": "44447", "M": "57755", "N": "65555",
    "O": "75557", "P": "75744", "Q": "75571", "R": "65655", "S": "74717", "T": "72222", "U": "55557",
    "V": "55552", "W": "55775", "X": "55255", "Y": "55222", "Z": "71247",
}  # fmt: skip


def write_png(path: str | Path, rgb: np.ndarray) -> None:
    """Write an (H, W, 3) uint8 image as an 8-bit RGB PNG (one IDAT chunk, no row filters)."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + row.tobytes() for row in rgb)  # filter byte 0 before each row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit depth, colour type 2 (RGB)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)


def draw_text(img: np.ndarray, x: int, y: int, text: str, color=BLACK) -> None:
    """Draw text with its top-left corner at (x, y); characters outside FONT draw as blanks."""
    for k, ch in enumerate(text.upper()):
        for row, octal in enumerate(FONT.get(ch, FONT[" "])):
            for col in range(3):
                if int(octal) >> (2 - col) & 1:
                    x0, y0 = x + (4 * k + col) * SCALE, y + row * SCALE
                    img[y0 : y0 + SCALE, x0 : x0 + SCALE] = color


def text_width(text: str) -> int:
    return (4 * len(text) - 1) * SCALE


def draw_line(img: np.ndarray, xs: np.ndarray, ys: np.ndarray, color, width: int = 2) -> None:
    """A polyline through pixel coordinates, `width` pixels thick."""
    for x0, y0, x1, y1 in zip(xs[:-1], ys[:-1], xs[1:], ys[1:]):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        px = np.rint(np.linspace(x0, x1, n)).astype(int)
        py = np.rint(np.linspace(y0, y1, n)).astype(int)
        for d in range(width):
            img[py + d - width // 2, px] = color
            img[py, px + d - width // 2] = color


def plot_losses(rows: list[dict], title: str = "") -> np.ndarray:
    """An (HEIGHT, WIDTH, 3) image of train loss and val loss against step."""
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r and "event" not in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    points = np.array([p for p in train + val if np.isfinite(p[1])], dtype=float).reshape(-1, 2)
    if len(points) == 0:
        raise ValueError("the metrics file has no finite loss values to plot; train for at least log_interval steps")
    x_lo, x_hi = 0.0, max(points[:, 0].max(), 1.0)
    y_lo, y_hi = points[:, 1].min(), points[:, 1].max()
    pad = 0.05 * (y_hi - y_lo) or 0.5
    y_lo, y_hi = y_lo - pad, y_hi + pad
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP  # pixel box; y grows downwards

    def to_px(data: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
        d = np.array([p for p in data if np.isfinite(p[1])], dtype=float).reshape(-1, 2)
        return x0 + (d[:, 0] - x_lo) / (x_hi - x_lo) * (x1 - x0), y0 + (d[:, 1] - y_lo) / (y_hi - y_lo) * (y1 - y0)

    img = np.full((HEIGHT, WIDTH, 3), 255, dtype=np.uint8)
    for k in range(5):  # grid lines and tick labels
        value = y_lo + (y_hi - y_lo) * k / 4
        y = round(y0 + (y1 - y0) * k / 4)
        img[y, x0:x1] = GREY
        label = f"{value:.3g}"
        draw_text(img, x0 - 8 - text_width(label), y - 5, label)
        step = x_lo + (x_hi - x_lo) * k / 4
        x = round(x0 + (x1 - x0) * k / 4)
        img[y1:y0, x] = GREY
        label = f"{step:.0f}"
        draw_text(img, x - text_width(label) // 2, y0 + 8, label)
    img[y1, x0:x1 + 1] = img[y0, x0:x1 + 1] = BLACK  # the box
    img[y1:y0 + 1, x0] = img[y1:y0 + 1, x1] = BLACK
    draw_text(img, (x0 + x1 - text_width("STEP")) // 2, HEIGHT - 22, "STEP")
    draw_text(img, x0, 12, title)
    if train:
        draw_line(img, *to_px(train), BLUE)
        draw_text(img, x1 - 200, 12, "TRAIN LOSS", BLUE)
    if val:
        vx, vy = to_px(val)
        if len(vx) > 1:
            draw_line(img, vx, vy, ORANGE)
        for x, y in zip(np.rint(vx).astype(int), np.rint(vy).astype(int)):
            img[y - 3 : y + 4, x - 3 : x + 4] = ORANGE
        draw_text(img, x1 - 80, 12, "VAL LOSS", ORANGE)
    return img


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [a for a in args if not a.startswith("--")]
    outs = [a.partition("=")[2] for a in args if a.startswith("--out=")]
    if len(paths) != 1 or len(outs) + len(paths) != len(args):
        print("usage: python -m gptlite.plot OUT_DIR|metrics.jsonl [--out=loss.png]", file=sys.stderr)
        return 2
    source = Path(paths[0])
    metrics = source if source.suffix == ".jsonl" else source / METRICS_FILE
    png = Path(outs[0]) if outs else metrics.with_name("loss.png")
    try:
        if not metrics.is_file():
            raise FileNotFoundError(f"{metrics} does not exist; train.py writes it into out_dir")
        write_png(png, plot_losses(read_metrics(metrics), title=str(metrics.parent.name)))
    except (ValueError, FileNotFoundError) as e:
        print(f"gptlite.plot: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
