"""Deterministic simulation of the scheduling core: the real sched/, cache/ and control/ code under a seeded
lane executor and virtual clock, with deterministic stand-ins for the model forwards (README: "Testing")."""
