"""Helpers behind the Snakemake pipeline: cells from configs, aggregation, tables, figures."""
