"""Put on PYTHONPATH of a server under test (tests/test_hardening_inputs.py): every call of
pickle.loads / pickle.load in that process and its children that sees the tests' canary bytes is
written to the file named by LENS_EVALS_PICKLE_CANARY_LOG. Unpickling itself goes on unchanged."""

import os
import pickle

CANARY = b"lens-evals-pickle-canary"
_log = os.environ.get("LENS_EVALS_PICKLE_CANARY_LOG")

if _log:
    _loads = pickle.loads

    def _record(data: bytes) -> None:
        if CANARY in bytes(data):
            with open(_log, "a") as out:
                out.write(f"{os.getpid()}\n")

    def loads(data, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        _record(data)
        return _loads(data, *args, **kwargs)

    def load(file, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        data = file.read()
        _record(data)
        return _loads(data, *args, **kwargs)

    pickle.loads, pickle.load = loads, load
