"""Evaluation videos: MP4 files written with PyAV, and a strip of frames for TensorBoard.

PyAV (the ``video`` extra) is one wheel that bundles FFmpeg's libraries and encodes in-process: no
``ffmpeg`` binary on the PATH, no subprocess to clean up, and the same library decodes the files
in the tests. imageio would need imageio-ffmpeg's binary and a pipe to it; TensorBoard's own
``add_video`` needs moviepy. The evaluator is the only caller, so recording never runs on the
training path, and a failure to encode is reported by the caller, never fatal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


class VideoUnavailable(RuntimeError):
    """PyAV is not installed (``pip install -e '.[video]'``)."""


def _as_frame(x) -> np.ndarray:
    a = np.asarray(x.cpu() if hasattr(x, "cpu") else x)
    if a.ndim == 2:
        a = np.repeat(a[..., None], 3, axis=-1)
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
        raise ValueError(f"a video frame must be [H, W, 3] (or 1 or 4 channels), got shape {a.shape}")
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    a = a[..., :3]
    if a.dtype != np.uint8:
        a = (np.clip(a, 0.0, 1.0) * 255).astype(np.uint8) if np.issubdtype(a.dtype, np.floating) else a.astype(np.uint8)
    h, w = a.shape[:2]
    if h % 2 or w % 2:                 # yuv420p needs even sides: repeat the last row / column
        a = np.pad(a, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    return np.ascontiguousarray(a)


def write_mp4(path: str | Path, frames: Sequence, fps: int = 30) -> Path:
    """Encode `frames` (uint8 ``[H, W, 3]`` arrays or tensors, all one size) as H.264 (MPEG-4 Part 2
    where the FFmpeg build has no x264) into `path`, written to a temporary name and renamed, so a
    reader never sees half a file. Returns the path."""
    try:
        import av
    except ImportError as e:
        raise VideoUnavailable("recording evaluation videos needs PyAV: pip install -e '.[video]'") from e
    if not frames:
        raise ValueError("write_mp4: no frames")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    first = _as_frame(frames[0])
    h, w = first.shape[:2]
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(tmp), mode="w", format="mp4") as out:
        stream = out.add_stream(codec, rate=int(fps))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for x in frames:
            a = _as_frame(x)
            if a.shape[:2] != (h, w):
                raise ValueError(f"write_mp4: frame of size {a.shape[:2]} after frames of size {(h, w)}")
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    tmp.replace(path)
    return path


def read_mp4(path: str | Path) -> np.ndarray:
    """Decode an MP4 into ``[frames, H, W, 3]`` uint8 (tests and tools)."""
    import av
    with av.open(str(path)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])


def frame_strip(frames: Sequence, count: int = 8, height: int = 96) -> np.ndarray:
    """`count` frames spread evenly over the episode, side by side, each scaled (nearest) to
    `height` rows: one ``[height, W, 3]`` uint8 image for TensorBoard."""
    if not frames:
        raise ValueError("frame_strip: no frames")
    idx = np.linspace(0, len(frames) - 1, num=min(count, len(frames))).round().astype(int)
    tiles = []
    for i in idx:
        a = _as_frame(frames[i])
        rows = (np.arange(height) * a.shape[0] // height).clip(max=a.shape[0] - 1)
        width = max(1, round(a.shape[1] * height / a.shape[0]))
        cols = (np.arange(width) * a.shape[1] // width).clip(max=a.shape[1] - 1)
        tiles.append(a[rows][:, cols])
    return np.concatenate(tiles, axis=1)
