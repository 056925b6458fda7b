# Every target sets up the virtual environment first if it is missing (pinned versions).
PY      := .venv/bin/python
STAMP   := .venv/.installed
L       ?=
FORCE   ?=

.PHONY: setup lab build test check demo bench gpucheck clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[gpu]"
	touch $(STAMP)

lab: $(STAMP)
	.venv/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/lessons

build: $(STAMP)
	$(PY) -m course.build $(if $(FORCE),--force)

test: $(STAMP)
	$(PY) -m course.grade $(L)

check: $(STAMP)
	$(PY) -m course.maintain check $(L)

demo: $(STAMP)
	@test -n "$(L)" || (echo "usage: make demo L=05" && exit 2)
	$(PY) -m course.maintain demo $(L)

bench: $(STAMP)
	$(PY) -m benchmarks $(L)

# On a GPU machine, with its own Python (no venv, no Jupyter needed): make gpucheck PY=python3
gpucheck:
	$(PY) -m course.gpu_report

clean:
	rm -rf build .pytest_cache
	find . -name __pycache__ -not -path "./.venv/*" -prune -exec rm -rf {} +
