// Python module oppo_engine._C: the page allocator. The cache ops register themselves with the torch
// dispatcher from torch_bindings.cpp when this module is loaded.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "allocator.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "oppo_engine compiled extension: page allocator; registers torch.ops.oppo.*";
  // The GIL is released around every call: the actor lane and the scorer lane allocate concurrently.
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<oppo::PageAllocator>(m, "PageAllocator")
      .def(py::init<int64_t>(), py::arg("num_pages"))
      .def("alloc", &oppo::PageAllocator::alloc, py::arg("n"), release(),
           "n page ids (refcount 1), or None when fewer than n are free (nothing is taken then)")
      .def("free", &oppo::PageAllocator::free, py::arg("ids"), release(),
           "drop one reference per id; pages at 0 return to the free list")
      .def("incref", &oppo::PageAllocator::incref, py::arg("ids"), release())
      .def("num_free", &oppo::PageAllocator::num_free, release())
      .def("refcount", &oppo::PageAllocator::refcount, py::arg("id"), release())
      .def_property_readonly("num_pages", &oppo::PageAllocator::num_pages);
  // Whether the CPU ops' at::parallel_for can use torch's intra-op threads (built with OpenMP).
#ifdef _OPENMP
  m.attr("intra_op_parallel") = true;
#else
  m.attr("intra_op_parallel") = false;
#endif
}
