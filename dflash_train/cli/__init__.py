"""Console entry points, each a thin ``main``: train, eval, labels, exposure, export-target, demo.

Nothing else in the package imports from here.
"""
