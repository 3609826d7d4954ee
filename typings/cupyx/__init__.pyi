# Stubs for the parts of cupyx that monadl's GPU tests use.
from contextlib import AbstractContextManager

def allow_synchronize(allow: bool) -> AbstractContextManager[None]: ...
