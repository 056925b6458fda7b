# Every target sets up the virtual environment first if it is missing (pinned versions).
PY      := .venv/bin/python
STAMP   := .venv/.installed
L       ?=
FORCE   ?=
# Notebooks started by `make lab` and `make demo` give NumPy's BLAS this many threads. One:
# lessons 01-04 multiply small matrices, where threads only wait for each other (lesson 03
# measures it); lessons 04-06 set the count themselves where they compare with a threaded BLAS.
BLAS_THREADS ?= 1

.PHONY: setup lab build test check browser demo bench gpucheck clean release grade-class gradescope slides serve

# The Python that creates .venv (3.11-3.13): `make setup PYTHON=python3.12` to choose another.
PYTHON ?= python3
# One constraints file for every platform: pins that differ carry environment markers.
CONSTRAINTS := constraints.txt
# GPU=0: no `gpu` extra (CuPy, NVRTC): the PTX checks of CUDA C (lessons 08-10, 14) then skip, saying why.
GPU ?= 1

setup: $(STAMP)

# A progress line and the result; pip's full output goes to build/setup.log.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) course/setup_venv.py .venv $(CONSTRAINTS) $(if $(filter 0,$(GPU)),--cpu)
	@touch $(STAMP)

# Run as root (a container, many cloud machines), JupyterLab refuses to start without --allow-root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	OPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) .venv/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/lessons $(ALLOW_ROOT) $(LAB_ARGS)

build: $(STAMP)
	$(PY) -m course.build $(if $(FORCE),--force)

test: $(STAMP)
	$(PY) -m course.grade $(L)

# Maintainers: the browser test's Python package (Playwright; the browser is the system's Chromium).
BROWSER_STAMP := .venv/.browser
$(BROWSER_STAMP): $(STAMP)
	@mkdir -p build && $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[browser]" > build/setup-browser.log 2>&1 || \
		(cat build/setup-browser.log; exit 1)
	@touch $(BROWSER_STAMP)

check: $(STAMP) $(BROWSER_STAMP)
	$(PY) -m course.maintain check $(L)

# Run All on every stub notebook in JupyterLab in Chromium (make check does four lessons of each
# kind and one solution notebook).
browser: $(STAMP) $(BROWSER_STAMP)
	$(PY) -m course.browser $(L)

demo: $(STAMP)
	@test -n "$(L)" || (echo "usage: make demo L=05" && exit 2)
	OPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) $(PY) -m course.maintain demo $(L)

# Instructors: a repository for the class, lessons up to UPTO, the answers of FROM..UPTO withheld (FROM
# defaults to UPTO, UPTO to the first lesson). DEST holding an earlier release: one more commit (students
# pull it). GRADER=dir: the private grading repository the Classroom workflow grades with.
release: $(STAMP)
	@test -n "$(DEST)" || (echo "usage: make release DEST=dir [FROM=NN] [UPTO=NN] [GRADER=dir] [POINTS=file]" && exit 2)
	$(PY) -m course.release "$(DEST)" $(if $(UPTO),--upto $(UPTO)) $(if $(FROM),--from $(FROM)) \
		$(if $(GRADER),--grader "$(GRADER)") $(if $(POINTS),--points "$(POINTS)")

# Instructors: grade exactly the lessons named, one folder per student (or Canvas's flat download), each
# lesson in its grading tree, the students' code isolated (course/isolation.py) -> build/grades/.
OUT ?= build/grades
ISOLATION ?= auto
grade-class: $(STAMP)
	@test -n "$(SUBMISSIONS)" -a -n "$(LESSONS)" || (echo "usage: make grade-class SUBMISSIONS=dir LESSONS=01,02,03 [FROM=NN] [OUT=dir] [ISOLATION=auto|namespaces|uid|none] [POINTS=file] [PARTIAL=tests|all] [DEADLINE=iso] [LATE='10%/day, max 50%'] [TIMES=file.csv]" && exit 2)
	$(PY) -m course.classgrade "$(SUBMISSIONS)" --lessons "$(LESSONS)" --out "$(OUT)" --isolation $(ISOLATION) \
		$(if $(FROM),--from $(FROM)) $(if $(POINTS),--points "$(POINTS)") $(if $(PARTIAL),--partial $(PARTIAL)) \
		$(if $(DEADLINE),--deadline "$(DEADLINE)") $(if $(LATE),--late "$(LATE)") $(if $(TIMES),--times "$(TIMES)")

# Instructors: Gradescope's autograder bundle for lesson L (FROM=NN: lessons FROM..L) in build/gradescope/.
gradescope: $(STAMP)
	@test -n "$(L)" || (echo "usage: make gradescope L=NN [FROM=NN] [LATE='10%/day'] [DEADLINE=iso] [POINTS=file] [PARTIAL=tests|all]" && exit 2)
	$(PY) -m course.gradescope build $(L) $(if $(FROM),--from $(FROM)) $(if $(LATE),--late "$(LATE)") \
		$(if $(DEADLINE),--deadline "$(DEADLINE)") $(if $(POINTS),--points "$(POINTS)") $(if $(PARTIAL),--partial $(PARTIAL))

# Lecturers: each lesson's executed demo notebook as an offline reveal.js slideshow in build/slides/
# (runs the demo unless build/demo/ has it; reveal.js and MathJax come from the `slides` extra, installed
# once; SHOTS=1 opens each in headless Chromium: a screenshot NN_topic.png, and a check that it loads
# nothing from the network and typesets every formula; SMALL=1 runs the demo small, MINITORCH_SMALL=1,
# into build/slides/small/: a quick preview, not the lecture's figures).
SLIDES_STAMP := .venv/.slides
$(SLIDES_STAMP): $(STAMP)
	@mkdir -p build && $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[slides]" > build/setup-slides.log 2>&1 || \
		(cat build/setup-slides.log; exit 1)
	@touch $(SLIDES_STAMP)

slides: $(STAMP) $(SLIDES_STAMP) $(if $(SHOTS),$(BROWSER_STAMP))
	OPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) $(PY) -m course.slides $(L) $(if $(SHOTS),--screenshot) $(if $(SMALL),--small)

# Lecturers: serve the tiny GPT (lesson 15) on http://127.0.0.1:$(PORT)/ until Ctrl-C
# (the first Ctrl-C finishes the requests in flight, a second stops at once).
PORT ?= 8000
serve: $(STAMP)
	$(PY) -c "from minitorch.server import serve; serve(port=$(PORT))"

bench: $(STAMP)
	$(PY) -m benchmarks $(L)

# On a GPU machine, with its own Python (no venv, no Jupyter needed): make gpucheck PY=python3
gpucheck:
	$(PY) -m course.gpu_report

clean:
	rm -rf build .pytest_cache
	find . -name __pycache__ -not -path "./.venv/*" -prune -exec rm -rf {} +
