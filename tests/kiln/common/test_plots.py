"""Tests for kiln.common.plots: line and interval plots are PNG images of the figure's size in pixels, with no
software stamp, the same bytes for the same plot, and every drawn part (series, band, line, interval) changing them
while an empty series changes nothing.
"""

from __future__ import annotations

import struct
import zlib

from kiln.common.plots import interval_plot_png, line_plot_png

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOSS = [(0, 5.0), (10, 4.0), (20, 3.5)]


def chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of each chunk of a PNG file, every CRC checked."""
    assert png[:8] == PNG_SIGNATURE
    out, pos = [], 8
    while pos < len(png):
        (n,) = struct.unpack(">I", png[pos:pos + 4])
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", png[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + data) == crc, kind
        out.append((kind, data))
        pos += 12 + n
    return out


def size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels from the IHDR chunk."""
    kind, data = chunks(png)[0]
    assert kind == b"IHDR"
    return struct.unpack(">II", data[:8])


def test_a_line_plot_is_a_png_of_6_by_3_2_inches_at_90_dpi_without_a_software_stamp():
    png = line_plot_png({"train loss": LOSS}, "Loss by step", "step", "nats/token")
    kinds = [k for k, _ in chunks(png)]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    assert size(png) == (540, 288)
    assert b"Software" not in png and b"Matplotlib" not in png and b"matplotlib" not in png


def test_the_same_line_plot_gives_the_same_bytes_and_an_empty_series_is_left_out():
    png = line_plot_png({"train loss": LOSS}, "Loss by step", "step", "nats/token")
    assert line_plot_png({"train loss": LOSS}, "Loss by step", "step", "nats/token") == png
    assert line_plot_png({"train loss": LOSS, "val loss": []}, "Loss by step", "step", "nats/token") == png
    assert line_plot_png({"train loss": LOSS}, "Loss by step", "step", "nats/token", bands={"ci": []}) == png


def test_each_drawn_part_of_a_line_plot_changes_the_image():
    base = line_plot_png({"train loss": LOSS}, "Loss by step", "step", "nats/token")
    variants = {
        "points": line_plot_png({"train loss": [(0, 5.0), (10, 4.0), (20, 3.0)]}, "Loss by step", "step", "nats/token"),
        "series": line_plot_png({"train loss": LOSS, "val loss": [(0, 5.5), (20, 4.5)]}, "Loss by step", "step",
                                "nats/token"),
        "band": line_plot_png({"train loss": LOSS}, "Loss by step", "step", "nats/token",
                              bands={"95% interval": [(0, 4.8, 5.2), (20, 3.2, 3.8)]}),
        "hline": line_plot_png({"train loss": LOSS}, "Loss by step", "step", "nats/token", hlines={"chance": 4.5}),
        "title": line_plot_png({"train loss": LOSS}, "Loss by token", "step", "nats/token"),
    }
    assert all(size(png) == (540, 288) for png in variants.values())
    assert len({base, *variants.values()}) == 1 + len(variants)


def test_an_interval_plot_grows_with_its_rows_and_draws_intervals_only_where_given():
    one = interval_plot_png([("lr 2e-3", 0.1, -0.05, 0.25)], "Change from baseline", "loss")
    three = interval_plot_png([("a", 0.1, -0.05, 0.25), ("b", -0.2, -0.3, -0.1), ("c", 0.0, None, None)],
                              "Change from baseline", "loss")
    assert size(one) == (540, round(90 * (0.9 + 0.35 * 1)))
    assert size(three) == (540, round(90 * (0.9 + 0.35 * 3)))
    assert size(interval_plot_png([], "Nothing", "loss")) == size(one)  # at least one row's height
    assert interval_plot_png([("lr 2e-3", 0.1, -0.05, 0.25)], "Change from baseline", "loss") == one
    dot_only = interval_plot_png([("lr 2e-3", 0.1, None, None)], "Change from baseline", "loss")
    half = interval_plot_png([("lr 2e-3", 0.1, -0.05, None)], "Change from baseline", "loss")
    assert dot_only != one and half == dot_only  # an interval needs both ends
    assert b"Software" not in three
