# Two entry points do all set-up on a fresh machine:
#   make demo   installs everything, then runs the demo (GPT-2 through thunder.jit + kforge on a GPU;
#               without a GPU it compiles every kernel and says what it needs a GPU for)
#   make test   installs everything, then runs the test suite (GPU tests skip without a GPU)
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test gpu-test clean

install:
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-build-isolation -e .

demo: install
	$(PYTHON) -m kforge demo

test: install
	$(PYTHON) -m pytest -ra -q tests

clean:
	rm -rf build python/kforge/_C*.so python/*.egg-info
