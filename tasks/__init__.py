"""Prefect tasks: each wraps one plain stage function of data_prep or models.

May import models, data_prep and difflm; never flows.
"""
