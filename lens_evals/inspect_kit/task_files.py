"""The repository's ``tasks/*.py`` files as the registered tasks themselves, not copies of them.

Inspect runs ``inspect eval tasks/x.py@name`` only for a file whose source has a ``@task``-decorated
function, and looks the task up by that function's name; a plain ``from ... import name`` is
neither. So each file holds::

    @task
    @same_as(packaged_task)
    def name() -> Task: ...

:func:`same_as` makes the function call the packaged task with the arguments it is given, with the
packaged task's signature (what ``-T`` checks and the log records) and docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from inspect_ai import Task


def same_as(packaged: Callable[..., Task]) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    def decorate(stub: Callable[..., Task]) -> Callable[..., Task]:
        def file_task(*args: Any, **kwargs: Any) -> Task:
            return packaged(*args, **kwargs)

        file_task.__name__ = file_task.__qualname__ = stub.__name__
        file_task.__module__ = stub.__module__
        # the signature and docstring are the packaged task's (inspect.signature follows __wrapped__)
        return functools.update_wrapper(file_task, packaged, assigned=("__doc__",), updated=())

    return decorate
