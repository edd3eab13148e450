"""Evaluations: score a model on a dataset with the jobs' reward sources, and compare two evaluations."""
