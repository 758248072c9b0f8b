// The parts of epcomm._epcomm (python/src): each file binds one concern; module.cpp calls them.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "epcomm/config.h"
#include "epcomm/token_format.h"

namespace epcomm_py {

namespace nb = nanobind;

void bind_errors(nb::module_& m);     // errors.cpp: ErrorCode, Error, InvalidArgument
void bind_config(nb::module_& m);     // config.cpp: the limits, Sizes, Config
void bind_bootstrap(nb::module_& m);  // bootstrap.cpp: Bootstrap and its kinds
void bind_group(nb::module_& m);      // group.cpp: Group
void bind_silu(nb::module_& m);       // silu.cpp: the padded layout and the SiLU kernels
void bind_reference(nb::module_& m);  // reference.cpp: the CPU reference model

// config.cpp: a format or dispatch path from its name (InvalidArgument naming the choices).
epcomm::TokenFormat parse_format(const std::string& name);
epcomm::DispatchPath parse_path(const std::string& name);

}  // namespace epcomm_py
