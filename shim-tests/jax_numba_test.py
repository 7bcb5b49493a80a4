"""JAX and numba-cuda under expseg (issue 11): a small deterministic computation each, whose
result digest shim-tests/run.sh compares between a native run and a run under expseg.

    python3 jax_numba_test.py jax|jax_bfc|numba
Prints "digest <hex>" (or "SKIP <why>"), and with RESULT_FILE set saves the results (numba: a
sample) there for run.sh to compare: JAX's within a tolerance, since XLA's autotuning may choose
another GEMM algorithm in each process. `jax` uses XLA_PYTHON_CLIENT_ALLOCATOR=platform so that
every buffer is a driver allocation of its own; `jax_bfc` keeps XLA's default allocator (one
large allocation at start)."""
import hashlib
import os
import sys


def save(parts):
    """The results (or, for large ones, a sample) for run.sh to compare, in $RESULT_FILE."""
    if os.environ.get("RESULT_FILE"):
        import numpy as np

        np.save(os.environ["RESULT_FILE"], np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in parts]))


def numba_run():
    import numpy as np

    # numba 0.68 registers overloads for numpy aliases that numpy 2.4 removed (np.row_stack);
    # on the GPU machine's pairing its import fails natively. Restore the alias for the
    # import; the kernel below does not use it.
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    try:
        from numba import cuda
    except ImportError as e:
        return f"SKIP numba: {e}"

    @cuda.jit
    def axpy(a, x, y, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a * x[i] + y[i]

    h = hashlib.sha256()
    parts = []
    rng = np.random.default_rng(0)
    for mib in [2, 16, 64, 256]:
        n = (mib << 20) // 4
        x = cuda.to_device(rng.standard_normal(n, dtype=np.float32))
        y = cuda.to_device(rng.standard_normal(n, dtype=np.float32))
        out = cuda.device_array(n, dtype=np.float32)
        axpy[(n + 255) // 256, 256](np.float32(1.5), x, y, out)
        host = out.copy_to_host()
        h.update(host.tobytes())
        parts.append(host[::1024])
        del x, y, out
    save(parts)
    return "digest " + h.hexdigest()


def jax_run(allocator):
    # "platform": every buffer is a driver allocation of its own; "default": XLA's BFC
    # allocator takes most of the GPU in one allocation at start.
    if allocator == "platform":
        os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as e:
        return f"SKIP jax: {e}"
    if not any(d.platform == "gpu" for d in jax.devices()):
        return "SKIP jax: no GPU backend"
    h = hashlib.sha256()
    parts = []
    key = jax.random.PRNGKey(0)
    for n in [256, 1024, 4096]:
        key, k1, k2 = jax.random.split(key, 3)
        a = jax.random.normal(k1, (n, n), dtype=jnp.float32)
        b = jax.random.normal(k2, (n, n), dtype=jnp.float32)
        c = jnp.tanh(a @ b / n).sum(axis=0)
        host = jax.device_get(c)
        h.update(host.tobytes())
        parts.append(host)
    save(parts)
    return "digest " + h.hexdigest()


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "numba"
    if which == "numba":
        print(numba_run())
    else:
        print(jax_run("default" if which == "jax_bfc" else "platform"))
