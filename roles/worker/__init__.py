"""The worker role: one pipeline stage served to the swarm [report 3.3.1]. The role's own modules
sit here; its parts live in rooms, each a subpackage whose `__init__.py` maps its modules. Rooms
import one way, lowest first (tests/unit/test_layers.py holds it):

    health, state, steps   import only the base below (and nothing of each other)
    averaging              imports health
    serving                imports steps
    sparseloco             imports health, steps and serving
    role.py                imports any of them

    role.py     the worker role: builds the parts, joins the stage, runs the supervisor loop
    config.py   the worker's configuration model
    errors.py   the worker's exceptions
    layout.py   the flat parameter layout every room that moves parameters shares
    evidence_reports.py   a replica's reports of poisoned averaging contributions: what the
                averaging and sparseloco rooms' reporters share
"""
