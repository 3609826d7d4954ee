"""Tests of monadl.dyna, mirroring the package."""
