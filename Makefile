# Two entry points do all set-up on a fresh machine:
#   make demo   installs everything, then runs the demo (GPT-2 through thunder.jit + kforge on a GPU;
#               without a GPU it compiles every kernel and says what it needs a GPU for)
#   make test   installs everything, then runs the test suite (GPU tests skip without a GPU)
# Everything goes into a virtual environment, .venv (VENV=dir for another): Debian and Ubuntu's
# system Python refuses pip installs (externally-managed-environment). PYTHON=python3 uses that
# interpreter and its environment instead, creating none.
VENV ?= .venv
ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
NEW_VENV := $(PYTHON)
endif
PIP := $(PYTHON) -m pip

.PHONY: install demo test clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)

# Build isolation off: the extension builds against the torch just installed from requirements.txt
# rather than a second download (`pip install .` with isolation works too: pyproject.toml).
install: $(NEW_VENV)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-build-isolation -e .

demo: install
	$(PYTHON) -m kforge demo

test: install
	$(PYTHON) -m pytest -ra -q tests

clean:
	rm -rf build python/kforge/_C*.so python/*.egg-info
