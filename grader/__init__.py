"""The workbook's grader: ``python -m grader`` (see grader/__main__.py)."""
