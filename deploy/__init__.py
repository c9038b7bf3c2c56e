"""Operations tooling beside docker-compose.yml, run from a checkout: `python -m deploy.stack up|down`.

Not part of the installed library: nothing in difflm/, data_prep/, models/, tasks/ or flows/ imports it.
"""
