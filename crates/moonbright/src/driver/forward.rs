//! `forward_calls!`: the one forwarding mechanism of the contract. Given a trait and the list of
//! its methods, it writes that trait's impl for [`Instrumented`](super::Instrumented) (each call
//! counted, timed or passed on, as its entry says) and for [`Backend`](super::Backend) (a `match`
//! on the backend, so every call is a static one, with no dynamic dispatch).
//!
//! An entry is a method's signature, then what the instrumented wrapper does with the call:
//! `=> counted(Kind)` counts it as `CallKind::Kind` (and fails it when a failure is planned),
//! `=> timed(Kind)` counts and times it, nothing passes it on unseen. Unsafe methods go in a
//! trailing `unsafe { ... }` block, with the same choice.

macro_rules! forward_calls {
    (@instrumented $self:ident, $name:ident, ($($arg:ident),*)) => {
        $self.inner.$name($($arg),*)
    };
    (@instrumented $self:ident, $name:ident, ($($arg:ident),*), $how:ident($kind:ident)) => {
        $self.$how($crate::driver::CallKind::$kind, || $self.inner.$name($($arg),*))
    };
    (
        $trait:ident {
            $( fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty
                $(=> $how:ident($kind:ident))?; )*
        }
        $( unsafe {
            $( fn $uname:ident(&self $(, $uarg:ident: $uty:ty)* $(,)?) -> $uret:ty
                $(=> $uhow:ident($ukind:ident))?; )*
        } )?
    ) => {
        impl<D: $trait> $trait for $crate::driver::Instrumented<D> {
            $(
                #[inline]
                fn $name(&self $(, $arg: $ty)*) -> $ret {
                    forward_calls!(@instrumented self, $name, ($($arg),*) $(, $how($kind))?)
                }
            )*
            $($(
                #[inline]
                unsafe fn $uname(&self $(, $uarg: $uty)*) -> $uret {
                    // SAFETY: the caller keeps this method's contract, and the wrapped driver's
                    // method has the same one.
                    unsafe {
                        forward_calls!(@instrumented self, $uname, ($($uarg),*) $(, $uhow($ukind))?)
                    }
                }
            )*)?
        }

        impl $trait for $crate::driver::Backend {
            $(
                #[inline]
                fn $name(&self $(, $arg: $ty)*) -> $ret {
                    match self {
                        $crate::driver::Backend::Cuda(d) => d.$name($($arg),*),
                        $crate::driver::Backend::Host(d) => d.$name($($arg),*),
                    }
                }
            )*
            $($(
                #[inline]
                unsafe fn $uname(&self $(, $uarg: $uty)*) -> $uret {
                    match self {
                        // SAFETY: the caller keeps this method's contract, and each backend's
                        // method has the same one.
                        $crate::driver::Backend::Cuda(d) => unsafe { d.$uname($($uarg),*) },
                        // SAFETY: as above.
                        $crate::driver::Backend::Host(d) => unsafe { d.$uname($($uarg),*) },
                    }
                }
            )*)?
        }
    };
}

pub(super) use forward_calls;
