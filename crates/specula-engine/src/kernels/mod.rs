//! Specula's own CPU kernels: the products whose reduction order the exactness promise depends on.

pub mod qmatmul;
