//! Multiversioning for plain-Rust kernels: [`multiversion!`] compiles one body twice, for the
//! baseline and with AVX-512 enabled, and picks one at run time. Rust never contracts
//! `a * b + c` into an FMA on its own, so both versions compute bit-identical results; only
//! the vector width differs. Helpers called from the body must be `#[inline(always)]` so
//! they are compiled inside the feature-enabled copy.

/// `multiversion! { fn name(args) { body } }` defines `fn name(args)`.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
                fn avx512($($arg: $ty),*) $body
                if $crate::cpu::Isa::detect().has_avx512() {
                    // SAFETY: the features were detected at run time.
                    return unsafe { avx512($($arg),*) };
                }
            }
            fn portable($($arg: $ty),*) $body
            portable($($arg),*)
        }
    };
}

pub(crate) use multiversion;
