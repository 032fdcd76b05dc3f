"""torch's autoload hook for tpcomm (the entry point `tpcomm` in the
"torch.backends" group, which `import torch` runs): registers the backend
name "tpcomm" with torch.distributed without loading tpcomm, so that
`init_process_group("tpcomm")` (or "cpu:tpcomm,cuda:tpcomm") works in a
script that never imports tpcomm; tpcomm itself loads when the first group
is made with it.

Off with torch's switch TORCH_DEVICE_BACKEND_AUTOLOAD=0 (no hook runs) or
TPCOMM_AUTOLOAD=0 (this one does nothing). It never raises into
`import torch`: a failure warns once, naming tpcomm and both switches."""

import os


def _create(dist_opts, backend_options):
    import tpcomm  # noqa: F401  (loads the extension; keeps this creator registered)
    from tpcomm._registration import _create_backend

    return _create_backend(dist_opts, backend_options)


def register():
    try:
        if os.environ.get("TPCOMM_AUTOLOAD", "1") == "0":
            return
        import torch.distributed as dist

        if not dist.is_available() or "TPCOMM" in dist.Backend._plugins:
            return
        dist.Backend.register_backend("tpcomm", _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    except Exception as e:  # noqa: BLE001  (never break `import torch`)
        import warnings

        warnings.warn(f"tpcomm: registering the torch.distributed backend 'tpcomm' when torch "
                      f"is imported failed ({type(e).__name__}: {e}); `import tpcomm` before "
                      f"init_process_group instead, and set TPCOMM_AUTOLOAD=0 (or torch's "
                      f"TORCH_DEVICE_BACKEND_AUTOLOAD=0) to skip this step", stacklevel=2)
