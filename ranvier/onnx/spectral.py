"""Converters of ONNX's Fourier transforms, DFT and STFT, as one matrix product each.

A DFT along an axis is linear in the real and imaginary parts of its input, so it is a
constant matrix: the one numpy's FFT makes of each basis vector (with ONNX's length,
inverse and one-sided rules). The signal, its axis moved last and its other axes
flattened to rows, is multiplied by it. The matrix holds (n · channels) × (outputs ·
channels) numbers, which suits the frame lengths of audio front ends.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .indexing import take
from .node import Node, converts


def _dft_matrix(n: int, channels: int, length: int, inverse: bool, onesided: bool) -> np.ndarray:
    """[n · channels, outputs · output channels]: row j is the transform of basis vector j
    of the signal (n positions of 1 real or 2 real-and-imaginary channels)."""
    basis = np.eye(n * channels).reshape(n * channels, n, channels)
    signal = basis[..., 0] + (1j * basis[..., 1] if channels == 2 else 0)
    if inverse and onesided:  # a one-sided spectrum back to its real signal
        return np.fft.irfft(signal, n=length, axis=1).reshape(n * channels, -1)
    spectrum = np.fft.ifft(signal, n=length, axis=1) if inverse else np.fft.fft(signal, n=length, axis=1)
    if onesided:
        spectrum = spectrum[:, :length // 2 + 1]
    return np.stack([spectrum.real, spectrum.imag], axis=-1).reshape(n * channels, -1)


def _transform_last(node: Node, x, matrix: np.ndarray, channels_out: int):
    """x [..., n, channels] times the DFT matrix, as [..., outputs, channels_out]. The
    product runs in float64, as numpy's FFT does: the sums of terms of opposite signs that
    give a spectrum's zeros leave float32 residues of 1e-6 times the signal."""
    rows = x.reshape([int(np.prod(x.shape[:-2], dtype=np.int64)), x.shape[-2] * x.shape[-1]])
    y = node.b.matmul(node.b.cast(rows, dtypes.DT_FLOAT64), node.b.const(matrix))
    return node.b.cast(y, x.dtype).reshape([*x.shape[:-2], matrix.shape[1] // channels_out, channels_out])


@converts("DFT")
def dft(node: Node):
    x = node.tensor(0)
    channels = x.shape[-1]
    if channels not in (1, 2) or x.rank < 2:
        raise node.error(f"its input of shape {x.shape} does not end in 1 (real) or 2 (complex) channels")
    if node.opset >= 20:
        axis = int(node.constant(2, "axis").item()) if node.optional(2) is not None else -2
    else:
        axis = int(node.attr("axis", 1))
    if not (-x.rank <= axis <= -2 or 0 <= axis <= x.rank - 2):
        raise node.error(f"axis {axis} is outside [-{x.rank}, -2] and [0, {x.rank - 2}] (the last axis holds the channels)")
    axis %= x.rank
    inverse, onesided = bool(node.attr("inverse", 0)), bool(node.attr("onesided", 0))
    n = x.shape[axis]
    if node.optional(1) is not None and np.size(node.inputs[1]):
        length = int(node.constant(1, "dft_length").item())
    else:
        length = 2 * (n - 1) if inverse and onesided else n
    order = [i for i in range(x.rank - 1) if i != axis] + [axis, x.rank - 1]
    moved = x if order == list(range(x.rank)) else x.transpose(order)
    y = _transform_last(node, moved, _dft_matrix(n, channels, length, inverse, onesided), 1 if inverse and onesided else 2)
    return y if order == list(range(x.rank)) else y.transpose(list(np.argsort(order)))


@converts("STFT")
def stft(node: Node):
    """The DFT of each frame of frame_length samples, frame_step apart, times the window:
    [batch, frames, bins, 2] (bins = length // 2 + 1 one-sided)."""
    signal = node.tensor(0)
    if signal.rank != 3 or signal.shape[-1] not in (1, 2):
        raise node.error(f"its signal of shape {signal.shape} is not [batch, samples, 1 or 2]")
    step = int(node.constant(1, "frame_step").item())
    window = node.optional(2)
    if node.optional(3) is not None:
        length = int(node.constant(3, "frame_length").item())
    elif window is not None:
        length = node.shape(2)[0]
    else:
        raise node.error("has neither a window nor a frame_length to size its frames")
    samples = signal.shape[1]
    if step < 1 or not 1 <= length <= samples:
        raise node.error(f"frames of {length} samples {step} apart do not fit its {samples} samples")
    frames = 1 + (samples - length) // step
    positions = (np.arange(frames)[:, None] * step + np.arange(length)).reshape(-1)
    framed = take(node, signal, positions, 1).reshape([signal.shape[0], frames, length, signal.shape[2]])
    if window is not None:
        framed = framed * node.tensor(2).reshape([1, 1, length, 1])
    onesided = bool(node.attr("onesided", 1))
    return _transform_last(node, framed, _dft_matrix(length, signal.shape[2], length, False, onesided), 2)
