"""Float64 NumPy layer primitives, written from the layer definitions (no torch).

Convolutions are im2col + one matmul: the window view costs nothing, the reshape copies
N*Ho*Wo*C*R*S values, which is fine for oracle-sized batches.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def conv2d(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int = 1, pad: int = 0
) -> np.ndarray:
    """x (N, C, H, W), w (K, C, R, S) -> (N, K, Ho, Wo), Ho = (H + 2*pad - R) // stride + 1."""
    n, c, _, _ = x.shape
    k, _, r, s = w.shape
    if pad:
        x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(x, (r, s), axis=(2, 3))[:, :, ::stride, ::stride]  # (N,C,Ho,Wo,R,S)
    ho, wo = win.shape[2], win.shape[3]
    cols = win.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * r * s)
    out = cols @ w.reshape(k, c * r * s).T  # (N*Ho*Wo, K)
    if b is not None:
        out += b
    return out.reshape(n, ho, wo, k).transpose(0, 3, 1, 2)


def conv1d(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int = 1, pad: int = 0
) -> np.ndarray:
    """x (N, C, L), w (K, C, R) -> (N, K, Lo), Lo = (L + 2*pad - R) // stride + 1."""
    n, c, _ = x.shape
    k, _, r = w.shape
    if pad:
        x = np.pad(x, ((0, 0), (0, 0), (pad, pad)))
    win = sliding_window_view(x, r, axis=2)[:, :, ::stride]  # (N, C, Lo, R)
    lo = win.shape[2]
    cols = win.transpose(0, 2, 1, 3).reshape(n * lo, c * r)
    out = cols @ w.reshape(k, c * r).T  # (N*Lo, K)
    if b is not None:
        out += b
    return out.reshape(n, lo, k).transpose(0, 2, 1)


def maxpool2d(x: np.ndarray, kernel: int, stride: int, pad: int = 0) -> np.ndarray:
    """(N, C, H, W) -> (N, C, Ho, Wo), floor mode; padding counts as -inf."""
    if pad:
        x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-np.inf)
    win = sliding_window_view(x, (kernel, kernel), axis=(2, 3))[:, :, ::stride, ::stride]
    return win.max(axis=(4, 5))


def maxpool1d(x: np.ndarray, kernel: int, stride: int) -> np.ndarray:
    """(N, C, L) -> (N, C, (L - kernel) // stride + 1)."""
    return sliding_window_view(x, kernel, axis=2)[:, :, ::stride].max(axis=3)


def avgpool_global(x: np.ndarray) -> np.ndarray:
    """(N, C, H, W) -> (N, C): mean over all spatial positions."""
    return x.mean(axis=(2, 3))


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """x (N, in), w (out, in) -> (N, out)."""
    out = x @ w.T
    return out if b is None else out + b


def lrn(
    x: np.ndarray, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 2.0
) -> np.ndarray:
    """Local response normalisation across channels, x (N, C, ...).

    b_c = a_c / (k + alpha/size * sum_{c' = c - size//2}^{c + (size-1)//2} a_{c'}^2) ** beta,
    channels outside [0, C) contributing zero (Caffe's and torch's convention: alpha / size).
    """
    sq = np.square(x)
    front, back = size // 2, (size - 1) // 2
    padded = np.pad(sq, [(0, 0), (front, back)] + [(0, 0)] * (x.ndim - 2))
    window_sum = sliding_window_view(padded, size, axis=1).sum(axis=-1)  # (N, C, ...)
    return x / (k + alpha / size * window_sum) ** beta


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """Normalise over the trailing dims of gamma's shape (biased variance), then scale, shift."""
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = np.square(x - mean).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def batchnorm_eval(
    x: np.ndarray,
    mean: np.ndarray,
    var: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray,
    eps: float = 1e-5,
) -> np.ndarray:
    """Inference-mode batch norm over channel axis 1 with running statistics."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    scale = gamma / np.sqrt(var + eps)
    return x * scale.reshape(shape) + (beta - mean * scale).reshape(shape)


def one_hot(indices: np.ndarray, depth: int) -> np.ndarray:
    """(N, L) integer indices -> (N, depth, L) float64; indices >= depth give all-zero columns."""
    n, length = indices.shape
    out = np.zeros((n, depth, length))
    valid = indices < depth
    rows, cols = np.nonzero(valid)
    out[rows, indices[rows, cols], cols] = 1.0
    return out
